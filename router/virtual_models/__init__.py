"""Virtual models: names that exist only in the router and resolve per request to real ones.

``route`` (predictive: rules on the request, optionally an HTTP classifier's score, one
inference) and ``cascade`` (stages small -> large with a judge per stage; no byte of a rejected
answer reaches the client). ``config`` is the YAML schema, ``route`` the pure resolver,
``cascade`` the executor over a caller-supplied ``send`` (the router's cache-aware proxy in
production), ``judges/`` the judges, ``answer`` the shapes of a buffered stage answer,
``stream`` an accepted answer as the SSE events a streaming client expects.
"""
