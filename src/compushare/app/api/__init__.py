"""The daemon's local HTTP API on 127.0.0.1: OpenAI-compatible chat completions and
a small control API, both behind a token kept in the node's data dir.

  auth.py     the token (created on first use, mode 0600) and its check
  engine.py   generations for HTTP clients: one Consumer per model, on the node's host
  app.py      the ASGI app (Starlette): /v1/models, /v1/chat/completions, /control/status
  dashboard.py  the dashboard: one self-contained page polling /control/dashboard
  server.py   serving it with Hypercorn inside the node's trio nursery
  client.py   calling the control API (status, tray)
"""
