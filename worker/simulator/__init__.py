"""The simulated worker: the engine with a latency model in place of the model."""
