"""The daemon's local HTTP API on 127.0.0.1: OpenAI's and Ollama's APIs, a chat page, a
dashboard and a small control API, behind a token kept in the node's data dir.

  auth.py     the token (created on first use, mode 0600) and its check
  requests.py every request field of the generation endpoints: accepted, ignored or refused (pure)
  structured.py  what a request asks of the reply's shape: a JSON schema, tools, tool_choice (pure)
  tools.py    tool calls: the formats chat templates teach, their grammars, replies parsed whole or streamed (pure)
  engine.py   generations for HTTP clients: one Consumer per model, on the node's host
  streaming.py  streamed replies (SSE, NDJSON) that a client's disconnect cancels
  openai_routes.py  /v1/chat/completions and /v1/completions
  ollama_routes.py  /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version
  app.py      the ASGI app (Starlette): its routes, the token's guard, the pages
  dashboard.py  the dashboard: one page polling /control/dashboard, charting the node's history
  server.py   serving it with Hypercorn inside the node's trio nursery
  client.py   calling the control API (status, tray)

The folder static/ (package data, no build step) holds the chat page (chat.html,
chat.css, chat.js) and the dashboard's charts (charts.js), served at /chat and /static/.
"""
