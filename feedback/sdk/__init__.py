"""The product team's feedback SDK: `FeedbackClient` (threads) and `AsyncFeedbackClient` (asyncio).

    fb = FeedbackClient("https://flywheel.internal", api_key="…")
    fb.thumbs_up(completion_id, user="u-42")    # O(1), never blocks; sent in the background

Only httpx and pydantic are needed (no torch); `feedback.sdk.client` describes batching, retries,
idempotency, fork safety and error reporting.
"""

from feedback.sdk.client import (
    AsyncFeedbackClient,
    ClientClosedError,
    FeedbackAPIError,
    FeedbackClient,
    FeedbackError,
    QueueFullError,
    RetriesExhaustedError,
    WindowClosedError,
    make_event,
)

__all__ = [
    "AsyncFeedbackClient",
    "ClientClosedError",
    "FeedbackAPIError",
    "FeedbackClient",
    "FeedbackError",
    "QueueFullError",
    "RetriesExhaustedError",
    "WindowClosedError",
    "make_event",
]
