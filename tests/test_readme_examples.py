"""The README's examples, run as written on the embedded model, give the texts committed in
`tests/golden/readme_examples.json`: the quick start's `generate`, the server's curl requests and its
openai-client chat, and the Python API's generations. A README edit that changes what an example prints,
or a change to the code behind it, fails here until the golden text is looked at and rewritten with
`OD_MOE_UPDATE_GOLDEN=1 python3 -m pytest tests/test_readme_examples.py`."""

import ast
import json
import os
import re
import shlex
from pathlib import Path

import pytest

import od_moe
from od_moe.cli import main
from od_moe.server import create_app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
GOLDEN = Path(__file__).parent / "golden" / "readme_examples.json"
UPDATE = os.environ.get("OD_MOE_UPDATE_GOLDEN") == "1"
# The Python API section's generations, each as the README writes it: `engine` is the section's first one.
API_CALLS = (
    'engine.generate("def fibonacci(n):", max_tokens=64)',
    'engine.stream_generate("import os\\n", max_tokens=32, temperature=0.7, seed=0)',
    'od_moe.generate("def add(a, b):", max_tokens=16)',
    'engine.batch_generate(["def add(a, b):", "import os\\n"], max_tokens=32, seed=[0, 1])',
)


def _section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(title: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _section(title), re.S)


@pytest.fixture(scope="module")
def golden():
    texts = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    seen = {}
    yield (
        lambda name, text: (
            seen.__setitem__(name, text) or (UPDATE or texts.get(name) == text, texts.get(name))
        )
    )
    if UPDATE:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({**texts, **seen}, indent=1, sort_keys=True) + "\n")


def _check(golden, name: str, text: str):
    ok, expected = golden(name, text)
    assert ok, f"{name}: the README's example now gives {text!r}, its golden text is {expected!r}"


def test_the_quick_start_generate_command(golden, capsys):
    first_line = _blocks("Quick start", "bash")[0].splitlines()[0]
    argv = shlex.split(first_line.split("python3 -m od_moe ", 1)[1])
    assert argv[0] == "generate" and "--ignore-chat-template" not in argv  # the embedded model continues text
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "decode" in out.err  # --stats went to standard error, the text alone to standard output
    _check(golden, "quick start", out.out)


@pytest.fixture(scope="module")
def client():
    (serve_line,) = [line for line in _blocks("Serving", "bash")[0].splitlines() if " serve " in line]
    capacity = shlex.split(serve_line.split("#")[0])[shlex.split(serve_line).index("--capacity") + 1]
    app = create_app(od_moe.load(capacity=capacity))
    yield app.test_client()
    app.worker.stop()


def _streamed_text(response) -> str:
    chunks = [line[6:] for line in response.get_data(as_text=True).splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    return "".join(json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])


def _curl_requests() -> list[tuple[str, dict]]:
    block = _blocks("Serving", "bash")[0].replace("\\\n", " ")
    return [
        (path, json.loads(body))
        for path, body in re.findall(r"localhost:8080(/v1/\S+) .*?-d '(\{.*?\})'", block)
    ]


def test_the_serving_curl_examples(golden, client):
    requests = _curl_requests()
    assert [path for path, _ in requests] == ["/v1/completions", "/v1/chat/completions"]
    for path, body in requests:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.get_data(as_text=True)
        if body.get("stream"):
            text = _streamed_text(response)
        else:
            text = response.get_json()["choices"][0]["text"]
        _check(golden, f"curl {path}", text)


def test_the_openai_client_example_is_the_chat_curl_and_continues_its_code(golden, client):
    """The client example sends the chat curl's request; on a tokenizer with no chat template the chat
    continues the user's code exactly as a completion of it does (the README says so)."""
    (source,) = _blocks("Serving", "python")
    call = ast.parse(source).body[-1].iter  # for chunk in client.chat.completions.create(...)
    arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "model"}
    path, curl = _curl_requests()[1]
    assert arguments == {**curl, "stream": True}
    chat = _streamed_text(client.post(path, json=arguments))
    _check(golden, "curl /v1/chat/completions", chat)
    (content,) = [m["content"] for m in arguments["messages"]]
    completion = client.post("/v1/completions", json={"prompt": content, "max_tokens": 32, "temperature": 0})
    assert completion.get_json()["choices"][0]["text"] == chat


def test_the_python_api_examples(golden):
    (block,) = _blocks("Python API", "python")
    engine = od_moe.load(capacity=0.25)
    assert "engine = od_moe.load(capacity=0.25)" in block
    for call in API_CALLS:
        assert call in block, f"the README no longer shows {call}"
        result = eval(call, {"engine": engine, "od_moe": od_moe})
        if "stream_generate" in call:
            result = "".join(r.text for r in result)
        elif "batch_generate" in call:
            result = "\n---\n".join(result.texts)
        _check(golden, call, result)
