"""`jaxstream serve`: an aiohttp adapter over the engine API (jaxstream.AsyncEngine).

One module per wire protocol (`vllm_realtime.py`), the pieces every protocol shares once (`websocket.py`:
a connection's lifecycle; `auth.py`, `limits.py`, `metrics.py`, `audio_codecs.py`), and `app.py`, which
wires routes, engine start-up, health and drain. `config.py` holds `ServerConfig` and the server TOML.
"""
