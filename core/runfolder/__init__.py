"""Run folders (``runs/<experiment>/<arm>/seed-N/``) as files: reading and writing them.

Below the engine, the experiment runner, labeling and the report, which all read or write run
folders; it imports only the package root and :mod:`alignzoo.config`.
"""
