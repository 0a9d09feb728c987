"""`g4rt plan` and `generate --model` with only the base dependencies, `serve --model` with only its
own extra.

Each command runs in a subprocess where the optional packages (the export, triton, test and
tensorrt extras; for one serve test also the serve extra) cannot be imported: `sys.modules[name] = None` makes `import name` fail and
`importlib.util.find_spec(name)` answer None, as on a machine that never installed them. Commands
that do need an extra must say which one instead of a traceback.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

EXTRAS = ("onnx", "onnxscript", "onnxruntime", "transformers", "triton", "tensorrt", "polygraphy")
SERVE_EXTRA = ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "jinja2")


def g4rt(*args, extra_blocked=()):
    blocked = EXTRAS + tuple(extra_blocked)
    prelude = (f"import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n"
               "from g4rt.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.Popen([sys.executable, "-c", prelude, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run(*args) -> subprocess.CompletedProcess:
    p = g4rt(*args)
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(args, p.returncode, out, err)


def test_plan_and_generate_without_extras():
    r = run("plan", "--model", "31b", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["model"] == "31b"
    r = run("generate", "--model", "tiny", "--prompt", "hello", "--max-new-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["outputs"][0]["token_ids"]) >= 1


def test_commands_that_need_an_extra_name_it(tmp_path):
    for args in (("export", "--model", "tiny", "--out", str(tmp_path / "e")),
                 ("build", "--model", "tiny", "--backend", "onnxruntime", "--out", str(tmp_path / "b"))):
        r = run(*args)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert "pip install 'g4rt[export]'" in r.stderr, r.stderr


def test_serve_without_extras_names_its_extra():
    """`serve` needs the serve extra (FastAPI, uvicorn, ...): without it, it says which, and stops."""
    p = g4rt("serve", "--model", "tiny", "--port", "0", extra_blocked=SERVE_EXTRA)
    out, err = p.communicate(timeout=300)
    assert p.returncode != 0 and "Traceback" not in err
    assert "pip install 'g4rt[serve]'" in err, err


def test_serve_with_only_its_own_extra():
    """With the serve extra but none of the others, `serve --model tiny` answers /health."""
    p = g4rt("serve", "--model", "tiny", "--port", "0")
    try:
        deadline = time.monotonic() + 120
        url = None
        while time.monotonic() < deadline and url is None:
            line = p.stdout.readline()
            if not line and p.poll() is not None:
                break
            if "http://" in line:
                url = line.split("http://", 1)[1].split()[0].rstrip(";,")
        assert url is not None, p.stderr.read() if p.poll() is not None else "no URL printed"
        with urllib.request.urlopen(f"http://{url}/health", timeout=30) as resp:
            assert resp.status == 200
    finally:
        p.kill()
        p.wait(timeout=30)


@pytest.mark.parametrize("module", ["g4rt.models.model", "g4rt.runtime.llm", "g4rt.plugins.ops"])
def test_library_modules_import_without_extras(module):
    code = f"import sys\nfor m in {EXTRAS!r}:\n    sys.modules[m] = None\nimport {module}\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
