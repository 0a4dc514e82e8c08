"""Serve a built package over the OpenAI chat-completions API (``python -m builder_plugin.serve PACKAGE``).

``protocol`` parses requests into conversations and writes response bodies, ``media`` turns data: URLs and base64
audio into cached files, ``stop`` finds stop strings in streamed text, ``worker`` answers one request at a time with
the package's ``Chat``, ``app`` is the ASGI app, ``__main__`` the command line. Needs the ``serve`` extra.
"""
