"""The rollout layer: how a step's samples come to be.

A single-turn arm asks its backend's ``generate`` hook for responses to prompts. A multi-turn
arm (one with an ``environment``) runs *episodes*: the environment opens each episode from a
dataset row (:mod:`alignzoo.rollout.episode` holds the records that cross the environment's
hooks), the backend samples the model's turn from token ids, a tool-call codec reads the calls
in it (:mod:`alignzoo.rollout.codecs`), the environment answers, and its answer is tokenised once
and appended, turn after turn, until the episode ends (:mod:`alignzoo.rollout.multiturn`).
"""
