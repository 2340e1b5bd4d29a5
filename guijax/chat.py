"""A client for OpenAI-compatible /chat/completions endpoints: the large-model roles of the papers (plan
extractor, skill extractor, trajectory judge) call one through it.

The API key is read from an environment variable named in the config, never from the config itself; a local
server (vLLM, SGLang, a test double) may need none (`api_key_env=""`). Transport failures, 429 and 5xx answers
are retried with exponential back-off; other HTTP errors and malformed replies raise `ChatError` with the URL
and the start of what came back.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import re
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Sequence, TypeVar


class ChatError(RuntimeError):
    """The endpoint could not be reached, refused the request, or answered something that is not a chat reply."""


class UnreadableAnswer(ChatError):
    """The endpoint answered, but no answer within the retries was what the caller asked for."""


@dataclasses.dataclass(frozen=True)
class ChatClient:
    url: str  # base URL, e.g. https://api.openai.com/v1 or http://localhost:8000/v1
    model: str
    api_key_env: str = "OPENAI_API_KEY"  # "" for a local server that needs no key
    timeout_s: float = 120.0
    http_retries: int = 3  # extra attempts after a transport failure, 429 or 5xx
    backoff_s: float = 2.0  # first wait between attempts; doubled each time
    temperature: float = 0.0

    def __post_init__(self):
        if not self.url:
            raise ValueError("ChatClient needs a URL (e.g. https://api.openai.com/v1)")
        if not self.model:
            raise ValueError(f"ChatClient for {self.url} needs a model name")

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ChatError(f"{self.url}: set the API key in the environment variable {self.api_key_env} "
                                "(or api_key_env='' for a server that needs none)")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def complete(self, messages: Sequence[dict[str, Any]], temperature: float | None = None) -> str:
        """The assistant's text for `messages` ([{"role": ..., "content": ...}])."""
        body = json.dumps({"model": self.model, "messages": list(messages),
                           "temperature": self.temperature if temperature is None else temperature}).encode()
        endpoint = self.url.rstrip("/") + "/chat/completions"
        delay = self.backoff_s
        for attempt in range(self.http_retries + 1):
            request = urllib.request.Request(endpoint, data=body, headers=self._headers())
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    raw = response.read()
                break
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode("utf-8", "replace")
                if (e.code == 429 or e.code >= 500) and attempt < self.http_retries:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise ChatError(f"{endpoint}: HTTP {e.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt < self.http_retries:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise ChatError(f"{endpoint}: {e} (after {self.http_retries + 1} attempts)") from None
        try:
            reply = json.loads(raw)
            content = reply["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ChatError(f"{endpoint}: not a chat completion: {raw[:200]!r}") from None
        if not isinstance(content, str):
            raise ChatError(f"{endpoint}: the reply's content is {type(content).__name__}, not text")
        return content


T = TypeVar("T")


def ask_parsed(client: ChatClient, messages: Sequence[dict[str, Any]], parse: Callable[[str], T], retries: int,
               what: str) -> T:
    """`parse` of the first answer it can read: an answer it refuses (ValueError) is asked again, up to `retries`
    more times, then a ChatError names the endpoint, `what` was asked for and every reason."""
    problems = []
    for _ in range(retries + 1):
        answer = client.complete(messages)
        try:
            return parse(answer)
        except ValueError as err:
            problems.append(str(err))
    raise UnreadableAnswer(f"{client.url}: no readable {what} after {retries + 1} answers: {'; '.join(problems)}")


def png_data_url(image: Any, max_side: int | None = None) -> str:
    """An [H, W, 3] uint8 screenshot as a base64 PNG data URL (the OpenAI-compatible image content form, also
    what an HTML page embeds), downscaled to `max_side` pixels on its longer side if larger."""
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.asarray(image, np.uint8))
    if max_side and max(img.size) > max_side:
        scale = max_side / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.BILINEAR)
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_part(image: Any, max_side: int | None = None) -> dict[str, Any]:
    """A screenshot as one part of a chat message's content (OpenAI-compatible), `png_data_url(image, max_side)`."""
    return {"type": "image_url", "image_url": {"url": png_data_url(image, max_side)}}


def json_reply(text: str) -> object:
    """The JSON value a model answered, which may be wrapped in a ```json fence and nothing else (ValueError
    when it is not JSON, or nested too deeply to decode)."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    try:
        return json.loads(fence.group(1) if fence else body)
    except RecursionError:  # nested deeper than Python decodes: an unreadable answer, not a crash
        raise ValueError("the JSON is nested too deeply to read") from None
