"""python -m builder_plugin.serve PACKAGE: serve a built package over the OpenAI API (chat completions, responses,
completions)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace

from builder_plugin import __version__
from builder_plugin.media.limits import MediaLimits
from builder_plugin.precisions import EXECUTION_PROVIDERS
from builder_plugin.serve import defaults

API_KEYS_VARIABLE = "BUILDER_PLUGIN_API_KEYS"
LIMITS = MediaLimits()


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m builder_plugin.serve",
                                description="Serve a Phi-4-multimodal package over the OpenAI API (chat "
                                "completions, responses, completions).")
    p.add_argument("--version", action="version", version=f"builder_plugin {__version__}")
    p.add_argument("package", help="folder of the built package (with genai_config.json)")
    p.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model id clients name in requests and GET /v1/models lists (default: the package "
                   "folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on; 0 picks a free one (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=defaults.MAX_QUEUE, metavar="N",
                   help="requests that may wait for a conversation to answer in; more get 429 (default: %(default)s)")
    p.add_argument("--max-conversations", type=int, default=defaults.MAX_CONVERSATIONS, metavar="N",
                   help="conversations kept with their KV caches, and answered at once, taking turns "
                   "(default: %(default)s)")
    p.add_argument("--kv-budget-gb", type=float, default=None, metavar="GB",
                   help="KV cache the kept conversations may hold; the least recently used is released first "
                   "(default: half the memory available once the model is loaded, at most --max-conversations "
                   "conversations of --max-length)")
    p.add_argument("--drain-seconds", type=float, default=defaults.DRAIN_SECONDS, metavar="S",
                   help="on SIGTERM, SIGINT or SIGHUP: how long answers in progress may go on before they end "
                   "with finish_reason \"length\"; meanwhile the server keeps listening and answers new requests and "
                   "GET /health with 503, then closes (default: %(default)s)")
    p.add_argument("--stored-responses", type=int, default=defaults.STORED_RESPONSES, metavar="N",
                   help="/v1/responses kept in memory (the last N with store true) for previous_response_id and GET "
                   "/v1/responses/ID; 0 keeps none (default: %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=32, metavar="N",
                   help="largest request body in MB; larger ones get 413 (default: %(default)s)")
    p.add_argument("--allow-local-files", action="store_true",
                   help="accept file:// image URLs (paths on this machine)")
    p.add_argument("--image-detail", choices=defaults.IMAGE_DETAILS_FOR_AUTO, default=defaults.IMAGE_DETAIL,
                   help="the detail of an image whose request leaves it to the server (detail \"auto\", or none): "
                   "high sends it whole (up to 36 crops of the model's: minutes on a CPU for a large photo), low "
                   "fits it to one crop (seconds) (default: %(default)s)")
    p.add_argument("--media-cache-mb", type=float, default=defaults.MEDIA_CACHE_MB, metavar="N",
                   help="decoded images and clips kept in memory, so a conversation sent again is not decoded again "
                   "(nothing a client sends is written to disk), in MB (default: %(default)s)")
    p.add_argument("--max-image-megapixels", type=float, default=LIMITS.max_image_pixels / 1e6, metavar="N",
                   help="largest image a request may send, in megapixels (default: %(default)g; also at most "
                   f"{LIMITS.max_image_side} pixels a side)")
    p.add_argument("--max-audio-seconds", type=float, default=LIMITS.max_audio_seconds, metavar="S",
                   help="longest audio clip a request may send (default: %(default)g)")
    p.add_argument("--media-timeout", type=float, default=LIMITS.decode_seconds, metavar="S",
                   help="an image or clip that takes longer to decode is refused (400) (default: %(default)g)")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest conversation in tokens, prompt included (default: the package's search.max_length)")
    p.add_argument("--max-tokens", type=int, default=defaults.MAX_TOKENS, metavar="N",
                   help="longest answer of a request without max_tokens; a request may ask for less, or for more "
                   "up to the maximum length (default: %(default)s)")
    p.add_argument("--api-key", action="append", metavar="KEY", dest="api_keys",
                   help="require `Authorization: Bearer KEY` on every API request (others get 401; GET /health "
                   "and the chat page stay open); repeat for several keys. Without --api-key, the comma-separated "
                   f"keys of ${API_KEYS_VARIABLE} are required if it is set and not empty (it keeps the keys out "
                   "of the process list); without either, every request is accepted")
    p.add_argument("--allowed-origins", action="append", metavar="ORIGINS",
                   help="browser origins (comma-separated, or repeat; e.g. https://app.example.com, * for any) whose "
                   "pages may call the server (CORS; preflights are answered without a key); default: none")
    p.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the chat page at / (the API only)")
    p.add_argument("-e", "--execution-provider", choices=EXECUTION_PROVIDERS, default=None,
                   help="run on this provider (default: the one the package was built for)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op threads of every session (default: one per physical core this process may use)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill a longer prompt N tokens per call where that computes what one call does (less "
                   "memory, and sooner on CPUs; default: the runtime's, runtime.package.PREFILL_CHUNK; 0: one call)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a log line per request (method, path, status, prompt tokens, time to the first token, "
                   "tokens/s; never a body or a key), debug logs and tracebacks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s: %(message)s")
    try:
        return serve(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.verbose:
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from builder_plugin.serve.app import MB, Server
        from builder_plugin.serve.cors import check_origins
        from builder_plugin.serve.pool import GB
        from builder_plugin.serve.shutdown import StoppableServer, interrupting_signals
    except ImportError as exc:
        raise RuntimeError(f"{exc.name} is missing: install the serve extra (pip install -e \".[serve]\")") from None

    from builder_plugin.media import MediaDecoder
    from builder_plugin.runtime import Package
    from builder_plugin.serve.media import MediaCache

    if args.max_queue < 1:
        raise ValueError("--max-queue must be at least 1")
    if args.max_body_mb <= 0 or args.media_cache_mb <= 0:
        raise ValueError("--max-body-mb and --media-cache-mb must be positive")
    if min(args.max_image_megapixels, args.max_audio_seconds, args.media_timeout) <= 0:
        raise ValueError("--max-image-megapixels, --max-audio-seconds and --media-timeout must be positive")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.stored_responses < 0:
        raise ValueError("--stored-responses must not be negative")
    if args.max_conversations < 1:
        raise ValueError("--max-conversations must be at least 1")
    if args.kv_budget_gb is not None and args.kv_budget_gb <= 0:
        raise ValueError("--kv-budget-gb must be positive")
    if args.drain_seconds < 0:
        raise ValueError("--drain-seconds must not be negative")
    if args.prefill_chunk is not None and args.prefill_chunk < 0:
        raise ValueError("--prefill-chunk must be a number of tokens, or 0 to prefill each prompt in one call")
    if args.served_model_name is not None and (not args.served_model_name.strip() or
                                               args.served_model_name != args.served_model_name.strip()):
        raise ValueError("--served-model-name must be a non-empty name without surrounding blanks")
    limits = replace(LIMITS, max_image_pixels=int(args.max_image_megapixels * 1e6),
                     max_audio_seconds=args.max_audio_seconds, decode_seconds=args.media_timeout)
    api_keys = requested_keys(args.api_keys, os.environ)
    origins = check_origins(args.allowed_origins or ())
    with interrupting_signals():  # stopped while loading: main() returns 130, nothing is left behind
        package = Package(args.package, max_length=args.max_length, execution_provider=args.execution_provider,
                          threads=args.threads,
                          **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk or None}))
        if args.image_detail == "low" and package.crop_side is None and package.genai_config["model"].get("vision"):
            raise ValueError("--image-detail low: this package's vision processor does not give its crop size")
        package.preload()  # the first requests do not wait for a decoder to load
        listener = socket.create_server((args.host, args.port))
        host, port = listener.getsockname()[:2]
        cache = MediaCache(MediaDecoder(limits, processes=defaults.MEDIA_PROCESSES), int(args.media_cache_mb * MB))
        try:
            budget = int(args.kv_budget_gb * GB) if args.kv_budget_gb is not None else None
            routes = Server(package, cache, model_id=args.served_model_name, max_queue=args.max_queue,
                            max_body_bytes=int(args.max_body_mb * MB), allow_local_files=args.allow_local_files,
                            max_tokens=args.max_tokens,
                            max_conversations=args.max_conversations, kv_budget_bytes=budget, api_keys=api_keys,
                            ui=args.ui, allowed_origins=origins, log_requests=args.verbose,
                            stored_responses=args.stored_responses, image_detail=args.image_detail)
            # -v: the request log's lines replace uvicorn's access log
            server = StoppableServer(uvicorn.Config(routes.app(), log_level="debug" if args.verbose else "info",
                                                    access_log=not args.verbose,
                                                    timeout_graceful_shutdown=args.drain_seconds + 5))
            server.drain = functools.partial(routes.worker.drain, args.drain_seconds, wait=True)
            print(f"serving {routes.model_id} at http://{host}:{port}/v1", flush=True)
            print(f"API keys: {len(api_keys)} accepted, required on every request but GET /health and the page"
                  if api_keys else
                  f"API keys: none (every request is accepted; --api-key or ${API_KEYS_VARIABLE} requires one)",
                  flush=True)
            print(f"up to {routes.pool.max_conversations} conversations at once, their KV caches kept under "
                  f"{routes.pool.kv_budget_bytes / GB:.2f} GB", flush=True)
            if routes.page is not None:
                print(f"chat page at http://{host}:{port}/ (--no-ui turns it off)", flush=True)
            if origins:
                print(f"browsers on {', '.join(origins)} may call the server (CORS)", flush=True)
            server.run(sockets=[listener])
        finally:
            cache.close()  # also done by the app's shutdown; here too in case it did not run
    if server.stopped_by is not None:
        print(f"stopped by {server.stopped_by.name}", flush=True)
    return 0


def requested_keys(flags: list[str] | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The --api-key keys, else those of the environment variable (none if it is unset or blank); raises ValueError
    for an empty key or one with whitespace."""
    from builder_plugin.serve.auth import check_keys

    if flags is not None:
        return check_keys(flags)
    listed = environ.get(API_KEYS_VARIABLE, "")
    if not listed.strip():
        return ()
    return check_keys([key.strip() for key in listed.split(",")], API_KEYS_VARIABLE)


if __name__ == "__main__":
    sys.exit(main())
