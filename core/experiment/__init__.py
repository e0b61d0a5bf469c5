"""The A/B runner: arms x seeds as separate processes, resume, failure isolation, run folders."""
