"""The fleet: the worker registry, health probes, circuit breakers, discovery, pre-warming and worker URL checks."""
