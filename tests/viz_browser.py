"""The viz page in headless Chromium: a script `tests/test_viz_browser.py` runs, inside a private
loopback-only network namespace where `unshare -n` works.

It starts `minfer viz MODEL`, loads the page, expands a layer and clicks a node inside it (real
mouse clicks at the nodes' drawn positions), runs a prompt until tokens have streamed, saves a
screenshot, and writes what it saw to OUT_DIR/result.json for the test to assert on. Chromium
is kept from every outside host: a dead loopback proxy, no name resolution, background
networking off, a fresh profile.

usage: python tests/viz_browser.py MODEL OUT_DIR
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def chromium_options(profile: Path) -> Any:
    from selenium.webdriver.chrome.options import Options

    opts = Options()
    opts.binary_location = CHROMIUM
    dead = free_port()  # bound, then closed: nothing listens there
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--proxy-server=http://127.0.0.1:{dead}",
                 "--proxy-bypass-list=localhost;127.0.0.1;[::1]",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic",
                 "--disable-features=OptimizationHints,MediaRouter,Translate",
                 "--window-size=1600,1000", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return opts


def wait_for(fn: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def click_graph_node(driver: Any, kind: str, ele_id: str) -> None:
    """A real mouse click where Cytoscape drew the element."""
    from selenium.webdriver.common.action_chains import ActionChains

    container = driver.find_element("id", f"cy-{kind}")
    pos = driver.execute_script(
        "const e = state.cys[arguments[0]].getElementById(arguments[1]);"
        "const p = e.renderedPosition(); return [p.x, p.y];", kind, ele_id)
    size = container.size
    ActionChains(driver).move_to_element_with_offset(
        container, int(pos[0] - size["width"] / 2), int(pos[1] - size["height"] / 2)
    ).click().perform()


def drive(url: str, out: Path) -> dict[str, Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    result: dict[str, Any] = {}
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER),
                              options=chromium_options(out / "profile"))
    try:
        driver.get(url)
        wait_for(lambda: driver.execute_script(
            "return !!(state.cys.decode && state.cys.prefill)"), 20, "the graphs")
        result["decode_nodes"] = driver.execute_script("return state.graphs.decode.nodes.length")
        result["collapsed_count"] = driver.execute_script("return state.cys.decode.nodes().length")
        click_graph_node(driver, "decode", "g:L0")  # expand layer 0
        wait_for(lambda: driver.execute_script("return state.expanded.decode.has('L0')"), 10,
                 "layer 0 to expand")
        result["expanded_count"] = driver.execute_script("return state.cys.decode.nodes().length")
        q_id = driver.execute_script(
            "return 'n' + state.graphs.decode.nodes.find(n => n.name === 'attn_q' "
            "&& n.layer === 0).id")
        click_graph_node(driver, "decode", q_id)
        result["payload"] = wait_for(lambda: driver.find_element("id", "node-payload").text, 10,
                                     "the node payload")
        driver.find_element("id", "prompt").clear()
        driver.find_element("id", "prompt").send_keys("Hello world")
        driver.find_element("id", "max-tokens").clear()
        driver.find_element("id", "max-tokens").send_keys("6")
        driver.find_element("id", "run").click()
        wait_for(lambda: "done" in driver.find_element("id", "status").text, 240,
                 "the generation to finish")
        result["tokens"] = driver.execute_script(
            "return [...document.querySelectorAll('#output .tok')].map(t => t.textContent)")
        result["steps"] = len(driver.find_elements("css selector", "#steps button"))
        result["status"] = driver.find_element("id", "status").text
        result["top5_rows"] = len(driver.find_elements("css selector", "#top5 .bar"))
        result["op_rows"] = len(driver.find_elements("css selector", "#op-times .bar"))
        driver.find_element("css selector", "#steps button[data-step='1']").click()
        wait_for(lambda: driver.execute_script("return state.selected === 1"), 10, "step 1")
        click_graph_node(driver, "decode", q_id)  # the node again, now with the step's stats
        result["stats"] = wait_for(lambda: driver.find_element("id", "node-stats").text, 10,
                                   "node statistics")
        driver.find_element("id", "diff").click()  # CPU vs torch, nodes coloured by max |Δ|
        result["diff_status"] = wait_for(
            lambda: driver.execute_script(
                "const s = document.getElementById('status').textContent;"
                "return /Δ|diff done|\\d{3}:/.test(s) && !document.getElementById('diff').disabled"
                " ? s : ''"), 120, "the diff")
        result["diff_coloured"] = driver.execute_script(
            "return state.colourBy === 'diff' ? state.cys.decode.nodes()"
            ".filter(n => n.data('bg') !== NO_DATA_BG).length : -1")
        click_graph_node(driver, "decode", q_id)
        time.sleep(0.5)
        driver.save_screenshot(str(out / "viz.png"))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        driver.save_screenshot(str(out / "failed.png"))
    finally:
        logs = driver.get_log("browser")
        result["console"] = [e for e in logs if e.get("level") in ("SEVERE", "ERROR")]
        result["console_other"] = [e for e in logs if e not in result["console"]]
        driver.quit()
    return result


def main(model: str, out_dir: str) -> int:
    out = Path(out_dir)
    port = free_port()
    env = dict(os.environ)
    server = subprocess.Popen(
        [sys.executable, "-m", "minfer.cli.main", "viz", model, "--port", str(port), "-c", "256",
         "--backend", "cpu"], env=env, stderr=open(out / "server.log", "w"))  # noqa: SIM115
    url = f"http://127.0.0.1:{port}/"
    try:
        def up() -> bool:
            try:
                with urllib.request.urlopen(url + "api/info", timeout=2) as resp:
                    return bool(resp.status == 200)
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("minfer viz exited") from None
                return False

        wait_for(up, 60, "minfer viz to listen")
        result = drive(url, out)
    except Exception as exc:  # reported to the test, which fails with it
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        server.terminate()
        server.wait(timeout=30)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
