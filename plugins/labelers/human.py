"""Labeler "human": people rate the responses, through a queue (:mod:`alignzoo.human.queue`).

Each call puts its requests in the queue at ``queue`` (a folder; several runs and raters may
share it), each wanting ``raters`` judgements on the ``scale``, and waits up to ``wait_s`` for
them. A response with at least ``min_raters`` values by then gets their ``aggregate`` (mean
or median), mapped to [0, 1] on the scale (``info``: the raw ratings); one without abstains
(``info["pending"]``), and the arm's ``labeling.on.abstain`` policy decides what happens to it
(by default the next labeler of the chain). After each step, ``human/items``,
``human/complete_frac`` and ``human/alpha`` (Krippendorff's alpha of the ratings) describe the
samples the run has queued so far (from the run's own process: with ``labeling.isolation:
process`` or a ``timeout_s``, calls run in a worker and these are not logged). Ratings that
arrive later are kept in the queue: a
later call for the same sample (the next run, a resumed one) finds them, and the pending
abstain is never kept in the label store. A response every rater marked "cannot judge"
abstains for good.

Whoever rates takes :meth:`HumanQueue.next_for` and answers :meth:`HumanQueue.submit`: a web
app, a script, or a simulated annotator in tests and demos. Keep ``wait_s`` under the arm's
``labeling.timeout_s`` (if set), or the call is ended as a timeout.
"""

from __future__ import annotations

from alignzoo.human.labeler import QueueLabeler


class HumanLabeler(QueueLabeler):
    """Ratings from people, through a queue that outlives the run."""
