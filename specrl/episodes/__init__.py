"""Multi-turn episodes: the environment protocol (env.py), the turn loop over the speculative
stage (runner.py) and the built-in calculator task's environment (calculator.py)."""
