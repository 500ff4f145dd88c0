"""HTTP handlers of the worker server (see worker/server/app.py)."""
