"""The server's defaults, in a module of their own so that ``--help`` reads them without importing the runtime."""

MAX_TOKENS = 1024  # of an answer without max_tokens: at ~10 tokens/s (full-size int4 on a CPU), two minutes
MAX_CONVERSATIONS = 8  # kept with their KV caches, and answered at once
MAX_QUEUE = 16  # requests waiting for a conversation to answer in
DRAIN_SECONDS = 10.0  # answers in progress may go on this long after a stop signal
MEDIA_CACHE_MB = 256  # decoded images and clips kept in memory
MEDIA_PROCESSES = 2  # decoder processes: a slow file holds one, not every request's media
STORED_RESPONSES = 256  # /v1/responses kept in memory for previous_response_id (their conversations and bodies)
IMAGE_DETAIL = "high"  # what an image's detail "auto" (or none) means: whole; "low" fits it to one crop of the model's
IMAGE_DETAILS_FOR_AUTO = ("high", "low")
