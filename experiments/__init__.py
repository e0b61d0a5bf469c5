"""The bundled experiments, installed as ``alignzoo.experiments`` (data only: YAML files).

This file makes the folder a regular package, so an editable install finds it too.
"""
