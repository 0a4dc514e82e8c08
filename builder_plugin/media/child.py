"""python -m builder_plugin.media.child: the decoder process. Reads requests (kind, limits, an image's fit; the file's
bytes) from stdin and writes answers (the canonical bytes, or the reason they are refused) to stdout, until stdin
closes.

Its address space is capped, so a decoder that allocates without bound fails here with MemoryError."""

from __future__ import annotations

import os
import resource
import sys

ADDRESS_SPACE = 4 << 30


def main() -> int:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's thread pool is not needed for a decode
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    from builder_plugin.media import frames
    from builder_plugin.media.canonical import Unreadable, canonical_audio, canonical_image
    from builder_plugin.media.limits import MediaLimits

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (message := frames.read(stdin)) is not None:
        header, data = message
        limits = MediaLimits(**header["limits"])
        try:
            if header["kind"] == "image":
                payload, info = canonical_image(data, limits, header.get("fit"))
            else:
                payload, info = canonical_audio(data, limits)
            answer = frames.encode({"ok": True, "info": info}, payload)
        except Unreadable as exc:
            answer = frames.encode({"ok": False, "reason": str(exc)})
        except MemoryError:
            answer = frames.encode({"ok": False, "reason": f"the {header['kind']} is too large to decode"})
        stdout.write(answer)
        stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
