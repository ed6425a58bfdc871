"""The product team's feedback SDK: `FeedbackClient` (threads) and `AsyncFeedbackClient` (asyncio).

    from feedback.sdk import FeedbackClient
    fb = FeedbackClient("https://flywheel.internal", api_key="…")
    fb.thumbs_up(completion_id, user="u-42")    # O(1), never blocks; sent in the background
    fb.rating(completion_id, 4)
    fb.edited(completion_id, kept_fraction=0.8, edit_distance=12)

Only httpx and pydantic are needed (no torch). See `feedback.sdk.client` for batching, retries,
idempotency, fork safety and error reporting.
"""

from feedback.sdk.aio import AsyncFeedbackClient
from feedback.sdk.client import (ClientClosedError, FeedbackAPIError, FeedbackClient, FeedbackError,
                                 QueueFullError, RetriesExhaustedError, make_event)

__all__ = ["AsyncFeedbackClient", "ClientClosedError", "FeedbackAPIError", "FeedbackClient", "FeedbackError",
           "QueueFullError", "RetriesExhaustedError", "make_event"]
