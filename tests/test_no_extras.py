"""`g4rt plan`, `generate --model` and `serve --model` with only the base dependencies.

Each command runs in a subprocess where the optional packages (the export, triton, test and
tensorrt extras) cannot be imported: `sys.modules[name] = None` makes `import name` fail and
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
_PRELUDE = (f"import sys\nfor m in {EXTRAS!r}:\n    sys.modules[m] = None\n"
            "from g4rt.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def g4rt(*args, **kw):
    return subprocess.Popen([sys.executable, "-c", _PRELUDE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


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


def test_serve_without_extras(tmp_path):
    """`serve --model tiny` either serves (its dependencies are all base ones) or names its extra."""
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
        if url is None:
            err = p.stderr.read()
            assert p.wait(timeout=30) != 0 and "Traceback" not in err and "pip install 'g4rt[" in err, err
            return
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
