"""tiny-functions' users: ask for completions through the OpenAI client, try the code, report feedback.

    python client.py --url http://127.0.0.1:8000 --completions 200

A user who gets code that passes keeps it (accepted, sometimes copied or a thumb up); one who gets code
that fails rejects it (sometimes a thumb down). Every completion is reported as shown first, so silence
has a meaning too (the reward table's `silence`).
"""

from __future__ import annotations

import argparse
import random

import openai
from tiny_suite import USER_PROMPTS, RunTheTests

from feedback.sdk.client import FeedbackClient


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="local", help="a key with the completions and feedback:write scopes")
    ap.add_argument("--completions", type=int, default=200)
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng, verifier = random.Random(a.seed), RunTheTests()
    client = openai.OpenAI(base_url=a.url + "/v1", api_key=a.api_key)
    feedback = FeedbackClient(a.url, api_key=None if a.api_key == "local" else a.api_key)
    passed = 0
    for i in range(a.completions):
        user, prompt = f"user-{rng.randrange(a.users)}", rng.choice(USER_PROMPTS)
        r = client.completions.create(
            model="flywheel", prompt=prompt, max_tokens=24, temperature=1.0, stop=["\n#"], user=user, seed=i
        )
        completion = r.choices[0]
        feedback.shown(r.id, user=user)
        if verifier.one(prompt, completion.text) == 1.0:
            passed += 1
            feedback.accepted(r.id, user=user)
            if rng.random() < 0.3:
                feedback.copied(r.id, user=user)
            if rng.random() < 0.2:
                feedback.thumbs_up(r.id, user=user)
        else:
            feedback.rejected(r.id, user=user)
            if rng.random() < 0.2:
                feedback.thumbs_down(r.id, user=user)
    feedback.close(30)
    print(f"{a.completions} completions, {passed} passed ({passed / a.completions:.0%}), by {r.model} last")


if __name__ == "__main__":
    main()
