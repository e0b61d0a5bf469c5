"""The bundled experiments, installed as ``alignzoo.experiments`` (data only: YAML files).

``alignzoo run NAME`` reads ``NAME.yaml`` from here when NAME is no file; ``alignzoo init DIR``
copies them, with the annotator files they name, into ``DIR/experiments/``. This file makes the
folder a regular package, so an editable install finds it too.
"""
