"""dctms.serve: an OpenAI-compatible HTTP server for a pool of plans within one memory envelope.

It imports ``dctms.runner`` and ``dctms.schema`` only (never the compiler, the TUI or mlx-lm model
code): the command line composes the pool's envelope and hands it in. Every MLX call runs on one
worker thread, one request at a time, so the pool's single shared arena is what the server needs.
``spec`` parses ``--plan`` arguments, ``worker`` owns the sessions and the queue, ``protocol``
validates requests and shapes responses, ``text`` detokenises a stream, ``security`` checks the
Host header and the API key, ``body`` reads a JSON body within its limits, ``app`` is the ASGI app
and ``server`` binds the socket and runs it (with a deadline for request heads).
"""
