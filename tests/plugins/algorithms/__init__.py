"""Tests of the online RL algorithms (PPO, GRPO, RLOO, REINFORCE++) and their shared ops."""
