#!/usr/bin/env python3
"""The demo upstream of `make run`, behaving as a small service would.

    python3 scripts/demo_upstream.py [PORT]        (8080 by default, on 127.0.0.1)

- Every request's body is read to its end (Content-Length or chunked), so a kept-alive
  connection stays in step whatever the client sends; connections are kept alive unless the
  client says `Connection: close`.
- Most paths answer 200 with a small JSON body naming the method, the path and the bytes read.
- `POST /v1/chat/completions` and `POST /v1/completions` answer as an LLM API does, reporting
  what the answer cost in `usage` (prompt, completion and total tokens): the prompt's tokens are
  its words, the completion's the reply's words, at most the request's `max_tokens`. With
  `"stream": true` the answer is a `text/event-stream` of chunks whose last `data:` event carries
  `usage`, then `data: [DONE]`. A JSON answer is gzip-compressed when the request's
  `Accept-Encoding` names gzip.
- `GET /healthz` answers 200 once the server listens (`make run` waits on it).
"""
import gzip
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPLY = "Rate limits keep one client from spending every other client's share of the service."
LLM_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_BODY = 16 << 20


def words(value):
    """The words of a prompt: a string, or the `content` of chat messages."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(words(m.get("content", "") if isinstance(m, dict) else m) for m in value)
    return 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle plus delayed ACKs
    # stall every keep-alive response by ~40 ms.
    disable_nagle_algorithm = True

    def _body(self):
        """The request body, read to its end whatever framing the client chose."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        if length > MAX_BODY:
            raise ValueError(f"a body of {length} bytes")
        return self.rfile.read(length) if length else b""

    def _send(self, status, body, content_type="application/json", extra=()):
        self.send_response(status)
        self.send_header("content-type", content_type)
        for name, value in extra:
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _answer(self):
        try:
            body = self._body()
        except ValueError as e:
            self.close_connection = True
            return self._send(400, json.dumps({"error": str(e)}).encode())
        path = self.path.split("?", 1)[0]
        if self.command == "POST" and path in LLM_PATHS:
            return self._completion(body)
        answer = {"upstream": "ok", "method": self.command, "path": self.path, "body_bytes": len(body)}
        self._send(200, json.dumps(answer).encode())

    def _completion(self, body):
        try:
            request = json.loads(body or b"{}")
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return self._send(400, json.dumps({"error": f"the body is not a JSON object: {e}"}).encode())
        max_tokens = request.get("max_tokens")
        reply = REPLY.split()
        if isinstance(max_tokens, int) and max_tokens >= 0:
            reply = reply[:max_tokens]
        prompt = words(request.get("messages", request.get("prompt", "")))
        usage = {"prompt_tokens": prompt, "completion_tokens": len(reply),
                 "total_tokens": prompt + len(reply)}
        model = request.get("model", "demo")
        if request.get("stream") is True:
            return self._stream(model, reply, usage)
        answer = {"object": "chat.completion", "model": model,
                  "choices": [{"index": 0, "finish_reason": "stop",
                               "message": {"role": "assistant", "content": " ".join(reply)}}],
                  "usage": usage}
        data = json.dumps(answer).encode()
        if "gzip" in self.headers.get("accept-encoding", "").lower():
            return self._send(200, gzip.compress(data), extra=[("content-encoding", "gzip")])
        self._send(200, data)

    def _stream(self, model, reply, usage):
        """A `text/event-stream`, chunked: one event a word, then usage, then [DONE]."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def event(data):
            payload = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            self.wfile.flush()

        for word in reply:
            event(json.dumps({"object": "chat.completion.chunk", "model": model,
                              "choices": [{"index": 0, "delta": {"content": word + " "}}]}))
        event(json.dumps({"object": "chat.completion.chunk", "model": model, "choices": [],
                          "usage": usage}))
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _answer

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8080
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"demo upstream listening on 127.0.0.1:{port}", flush=True)
    server.serve_forever()
