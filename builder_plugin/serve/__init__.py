"""Serve a built package over the OpenAI chat-completions API (``python -m builder_plugin.serve PACKAGE``).

``protocol`` parses requests into conversations and writes response bodies, ``media`` turns data: URLs and base64
audio into cached files, ``stop`` finds stop strings in streamed text, ``pool`` keeps several conversations' Chats
(and their KV caches) under a budget, ``worker`` answers the requests in them, taking turns, ``app`` is the ASGI app,
``defaults`` the command line's defaults, ``__main__`` the command line. Needs the ``serve`` extra.
"""
