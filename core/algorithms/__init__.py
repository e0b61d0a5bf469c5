"""Bases that several algorithms share (RLOO and REINFORCE++ take theirs from
:mod:`alignzoo.algorithms.reinforce`), so that no built-in plugin imports another; this package
imports only the package root.
"""
