"""Fuzz the runner's HTTP surface: generated bodies against a real runner process.

    python -m bench.fuzz --bodies 10000 --seed 1 [--out DIR] [--model-dir DIR]
    python -m bench.fuzz --bodies 0 --media full     # the hostile-media section alone

Writes a tiny random-weight Llama (tests/tiny.py) to a temporary directory, spawns
`python -m runner --model DIR` (tools/spawned.py) and sends it generated bodies for
`/v1/score`, `/v1/completions` and `/v1/tokenize`, one at a time, while a second process polls
`/v1/status`. Bodies are built from docs/openapi.yaml's request schemas (field names, types,
limits) with the tiny model's vocabulary, so most are valid, and then mutated with Hypothesis:
wrong types, huge and negative numbers, integers beyond int64, NaN/Infinity literals, deep
nesting, unknown, duplicate and re-spelled keys, invalid UTF-8, lone surrogates, control
characters, trailing data, empty and truncated bodies, very long strings, `[img-N]` tags with
and without media, bad base64, bodies over the 64 MiB limit.

Checks after every body (names as in the summary and in tests/test_fuzz.py):

- `answered`: an HTTP answer came back whole (no dropped connection, no timeout);
- `no-5xx`: the status is 200 or 4xx;
- `schema`: the answer is one docs/openapi.yaml documents for the operation, and its body
  matches the schema (JSON parsed strictly: NaN/Infinity literals rejected; every line of a
  completions stream, the last one with `Done: true`);
- `no-error-line`: a completions stream carries no `Error` line;
- `alive`: the runner process is still running;
- `go-status`: the status is the one the Go runner would give. A model of Go's
  `json.NewDecoder(body).Decode(&request)` (`go_oracle`: first value only, trailing data
  ignored, depth limit 10000, invalid UTF-8 and lone surrogates become U+FFFD, int fields
  must be int64 integer literals, Options numbers float32, null a no-op except for slices,
  keys folded as Go folds them, duplicate keys decoded into the same field in order) says
  whether Go rejects the body (then the answer must be 400) or what it decodes to; in that
  case the decoded request, written canonically, is sent too (a "twin") and the two
  answers must have the same status;
- `go-message`: a 400's text is the one Go's would have (`Bad Request` for a completions body
  Go cannot decode; otherwise the twin's text, the runner's own validation message).

Throughout, `/v1/status` must answer within 100 ms (`status-latency`; the worst latency and
the body in flight then are reported). A body that fails a check is written to the output
directory (`NNNNN-ENDPOINT.body`, the exact bytes sent, with `NNNNN-ENDPOINT.json`: the
checks failed, the answer, Go's verdict). The summary gives bodies by endpoint and status,
failures by check with their first bodies, the worst `/v1/status` latency and the runner's
RSS before and after. Needs `hypothesis` and `jsonschema` (the `test` extra).

One job per module (this file imports none of them):

- `openapi`: docs/openapi.yaml read and walked; answers checked against it (strict JSON);
- `nodes`: JSON bodies as trees that can hold what `json.dumps` cannot write;
- `go_oracle`: an independent model of Go's `encoding/json` decoding a request body (the
  oracle of `go-status` and `go-message`), tested by tests/test_go_oracle.py;
- `cases`: the generated bodies (schemas, vocabulary, mutations, Hypothesis);
- `client`: HTTP to the runner: a POST read as the checks need it, the `/v1/status` poller;
- `process`: the runner under test as a process: the tiny model, the spawn, its RSS;
- `fuzzer`: each case sent and every answer judged by the checks; a whole run;
- `report`: the checks' names, the run's record, its summary and JSON form;
- `media`: the hostile-media section (`--media small|full`): images that cost far more than
  their bytes (J, a 653-byte JPEG declaring 9000 x 9000; a 330 KB RGBA PNG of 81
  megapixels; a million tags) against spawned tiny Gemma3 and Qwen3.5 runners, each case's
  answer judged and its time, peak RSS and `/v1/status` latency reported;
- `__main__`: the command line.
"""
