"""Human feedback: people (or simulated annotators) judge samples, and their judgements become
training data and reward models.

- :mod:`~alignzoo.human.queue`: the queue of samples for raters (SQLite in WAL mode, shared by
  runs and annotators), behind the ``human`` labeler;
- :mod:`~alignzoo.human.app`: ``alignzoo annotate serve``, the annotation web app and its API;
- :mod:`~alignzoo.human.simulate`: simulated annotators, and a pool of the warm start's samples;
- :mod:`~alignzoo.human.agreement`: Krippendorff's alpha, pairwise agreement, the filter;
- :mod:`~alignzoo.human.export`: agreed judgements as preference / unpaired datasets;
- :mod:`~alignzoo.human.reward_model`: ``alignzoo train-rm``, a reward model from preferences.
"""
