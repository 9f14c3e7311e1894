"""Drive the real Airflow 3 web UI with headless Chromium, the way a person does.

A helper module for end-to-end tests, not a test itself. It needs Debian's ``chromium``
(``apt-get install -y chromium``) and the ``playwright`` Python package; Playwright's own browser
download (``playwright install``) is never used: Chromium is launched from ``shutil.which("chromium")``.

What a person does, and what this module does, on Airflow 3.3's UI with the SimpleAuthManager:

* sign in on ``/auth/login`` (fields ``username`` and ``password``, then "Sign in");
* open ``/dags/<dag_id>``, press "Trigger" (``data-testid=trigger-dag-button``) and fill the
  "Run Parameters" of the dialog, one widget per Param (see ``_fill_param``);
* press the dialog's "Trigger" (``data-testid=trigger-dag-submit``): the UI POSTs
  ``/api/v2/dags/<dag_id>/dagRuns`` and then navigates to ``/dags/<dag_id>/runs/<run_id>``.

Every wait is on a condition (``expect`` / ``wait_for_url`` with a timeout); the only sleep is the
interval between REST polls in ``wait_for_run``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import httpx
from playwright.sync_api import Locator, Page, Response, ViewportSize, expect, sync_playwright

#: Default timeout of one UI step (page load, a widget showing up, the POST answering), in ms.
STEP_TIMEOUT_MS = 60_000
# expect() waits on its own 5 s default, which a page still loading on a busy 2-core machine outlasted in CI.
expect.set_options(timeout=STEP_TIMEOUT_MS)
#: Dag run states after which nothing changes any more.
TERMINAL_RUN_STATES = frozenset({"success", "failed"})
#: Tall enough that the trigger dialog, with a handful of params, fits on one screenshot.
VIEWPORT: ViewportSize = {"width": 1400, "height": 1400}
#: How far screenshot_grid() drags the grid panel wider than its default 20% of the page.
GRID_PANEL_EXTRA_PX = 350


class UIError(RuntimeError):
    """The UI did not do what a person would have seen it do."""


# --------------------------------------------------------------------------- REST


def api_token(base_url: str, username: str, password: str) -> str:
    """A JWT for the REST API, from ``POST /auth/token``."""
    response = httpx.post(
        f"{base_url.rstrip('/')}/auth/token", json={"username": username, "password": password}, timeout=30.0
    )
    response.raise_for_status()
    return str(response.json()["access_token"])


def api_client(base_url: str, username: str, password: str) -> httpx.Client:
    """An ``httpx.Client`` on ``<base_url>/api/v2`` that sends a fresh JWT; close it after use."""
    token = api_token(base_url, username, password)
    return httpx.Client(
        base_url=f"{base_url.rstrip('/')}/api/v2", headers={"Authorization": f"Bearer {token}"}, timeout=30.0
    )


def unpause_dag(base_url: str, username: str, password: str, dag_id: str) -> None:
    """``PATCH /api/v2/dags/{dag_id}`` with ``{"is_paused": false}``."""
    with api_client(base_url, username, password) as api:
        response = api.patch(f"/dags/{dag_id}", json={"is_paused": False})
        response.raise_for_status()


def get_dag_run(base_url: str, username: str, password: str, dag_id: str, run_id: str) -> dict[str, Any]:
    """``GET /api/v2/dags/{dag_id}/dagRuns/{run_id}``."""
    with api_client(base_url, username, password) as api:
        response = api.get(f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
        response.raise_for_status()
        return dict(response.json())


def latest_dag_run_id(base_url: str, username: str, password: str, dag_id: str) -> str | None:
    """The newest run's id from ``GET /api/v2/dags/{dag_id}/dagRuns?order_by=-run_after``."""
    with api_client(base_url, username, password) as api:
        response = api.get(f"/dags/{dag_id}/dagRuns", params={"order_by": "-run_after", "limit": 1})
        response.raise_for_status()
        runs = response.json()["dag_runs"]
        return str(runs[0]["dag_run_id"]) if runs else None


def wait_for_run(
    base_url: str,
    username: str,
    password: str,
    dag_id: str,
    run_id: str,
    timeout: float = 300.0,
    poll_interval: float = 1.0,
) -> dict[str, Any]:
    """Poll the run over REST until it is ``success`` or ``failed`` and return it; ``TimeoutError`` at ``timeout``."""
    deadline = time.monotonic() + timeout
    with api_client(base_url, username, password) as api:
        while True:
            response = api.get(f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
            if response.status_code == 401:  # the JWT expired during a long run: take a new one
                api.headers["Authorization"] = f"Bearer {api_token(base_url, username, password)}"
                continue
            response.raise_for_status()
            run = dict(response.json())
            if run["state"] in TERMINAL_RUN_STATES:
                return run
            if time.monotonic() >= deadline:
                raise TimeoutError(f"dag run {dag_id}/{run_id} still {run['state']!r} after {timeout:.0f}s")
            time.sleep(poll_interval)


# --------------------------------------------------------------------------- browser


@contextmanager
def browser_page(failure_screenshot: Path | None = None) -> Iterator[Page]:
    """A fresh headless Chromium page (Debian's ``chromium``); on an error, screenshot it to ``failure_screenshot``."""
    executable = shutil.which("chromium")
    if executable is None:
        raise UIError("no `chromium` on PATH: apt-get update && apt-get install -y chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(STEP_TIMEOUT_MS)
            try:
                yield page
            except BaseException:
                if failure_screenshot is not None:
                    failure_screenshot.parent.mkdir(parents=True, exist_ok=True)
                    with suppress(Exception):  # the original error matters more
                        page.screenshot(path=str(failure_screenshot))
                raise
        finally:
            browser.close()


def login(page: Page, base_url: str, username: str, password: str, path: str) -> None:
    """Open ``path``; if the UI sends us to its login page, sign in there and wait to be sent back."""
    page.goto(f"{base_url.rstrip('/')}{path}")
    user_field = page.locator("input[name=username]")
    app = page.get_by_test_id("nav-sidebar")
    expect(user_field.or_(app).first).to_be_visible()
    if not user_field.is_visible():
        return  # already signed in
    user_field.fill(username)
    page.locator("input[name=password]").fill(password)
    page.locator("button[type=submit]").click()
    refused = page.get_by_text(re.compile(r"^\d{3} \w"))  # the login page's alert, e.g. "401 Unauthorized ..."
    expect(app.or_(refused).first).to_be_visible()
    if not app.is_visible():
        raise UIError(f"sign-in as {username!r} failed: {_visible_text(page)[:300]}")


def open_trigger_form(page: Page, dag_id: str) -> Locator:
    """On the Dag's page, press "Trigger" and return the trigger dialog once its form is shown."""
    button = page.get_by_test_id("trigger-dag-button")
    expect(button).to_be_enabled()
    button.click()
    dialog = page.get_by_role("dialog").filter(has=page.get_by_test_id("trigger-dag-submit"))
    expect(dialog).to_be_visible()
    expect(dialog.get_by_role("heading")).to_contain_text(dag_id)
    expect(dialog.get_by_test_id("config-form")).to_be_visible()
    return dialog


def _fill_param(page: Page, dialog: Locator, name: str, value: Any) -> None:
    """Fill one "Run Parameters" field of the trigger dialog as a person would, then check what it shows.

    Airflow 3.3 renders each Param as a widget named ``element_<name>``:

    * ``enum``              -> a react-select dropdown ``div#element_<name>``: click it, then click the option
                               (``role=option``, exact label); its hidden ``input[name=element_<name>]`` holds
                               the chosen value;
    * array of strings      -> ``textarea[name=element_<name>]``, one string per line;
    * ``integer``/``number``-> a spin button ``input[role=spinbutton][name=element_<name>]``; it clamps to
                               ``minimum``/``maximum`` when it loses focus, so an out-of-range value cannot be typed;
    * ``boolean``           -> a switch: a hidden ``input[type=checkbox][name=element_<name>]`` inside
                               ``label#switch:element_<name>``, toggled by clicking the label;
    * plain string          -> ``input[name=element_<name>]``.
    """
    widget = f"element_{name}"
    dropdown = dialog.locator(f'div[id="{widget}"]')
    textarea = dialog.locator(f'textarea[name="{widget}"]')
    switch_input = dialog.locator(f'input[type=checkbox][name="{widget}"]')
    spin = dialog.locator(f'input[role=spinbutton][name="{widget}"]')
    plain = dialog.locator(f'input[name="{widget}"]:not([type=hidden]):not([type=checkbox]):not([role=spinbutton])')
    anything = dropdown.or_(textarea).or_(switch_input).or_(spin).or_(plain)
    try:
        expect(anything.first).to_be_attached()
    except AssertionError as exc:
        raise UIError(f"the trigger form has no field for param {name!r}") from exc

    if dropdown.count():
        if isinstance(value, list | tuple | dict):
            raise UIError(f"param {name!r} is a single-choice dropdown; got {value!r}")
        label = str(value)
        dropdown.click()
        page.get_by_role("option", name=label, exact=True).click()
        expect(dropdown.locator(f'input[type=hidden][name="{widget}"]')).to_have_value(label)
    elif textarea.count():
        text = "\n".join(str(item) for item in value) if isinstance(value, list | tuple) else str(value)
        textarea.fill(text)
        expect(textarea).to_have_value(text)
    elif switch_input.count():
        if not isinstance(value, bool):
            raise UIError(f"param {name!r} is a toggle; got {value!r}")
        if switch_input.is_checked() != value:
            dialog.locator(f'label[id="switch:{widget}"]').click()
        expect(switch_input).to_be_checked(checked=value)
    elif spin.count():
        spin.fill(str(value))
        spin.press("Tab")  # leave the field, as a person would: the widget validates/clamps on blur
        shown = spin.input_value()
        if shown != str(value):
            raise UIError(
                f"the form changed param {name!r} from {value!r} to {shown!r} (out of its range?); "
                "use submit_invalid() to send an invalid value"
            )
    else:
        plain.fill(str(value))
        expect(plain).to_have_value(str(value))


def _is_trigger_post(dag_id: str) -> Callable[[Response], bool]:
    """Matches the UI's ``POST /api/v2/dags/{dag_id}/dagRuns`` (the trigger itself)."""
    path = f"/api/v2/dags/{dag_id}/dagRuns"
    return lambda response: response.request.method == "POST" and response.url.split("?")[0].endswith(path)


def _visible_text(page: Page) -> str:
    try:
        return " ".join(page.locator("body").inner_text(timeout=2_000).split())
    except Exception:  # only used to enrich an error message
        return "<page text unavailable>"


def _error_detail(response: Response) -> str:
    try:
        detail = response.json().get("detail", response.text())
    except (json.JSONDecodeError, AttributeError):
        detail = response.text()
    return detail if isinstance(detail, str) else json.dumps(detail)


def _refusal_alert(dialog: Locator, detail: str) -> Locator:
    """The red alert the dialog shows for a refused POST ("400 Bad Request" + Airflow's detail)."""
    first_line = next((line.strip() for line in detail.splitlines() if line.strip()), detail)
    message = dialog.get_by_text(first_line[:200]).first
    expect(message).to_be_visible()
    return message.locator("xpath=..")


def trigger_from_ui(
    base_url: str,
    username: str,
    password: str,
    dag_id: str,
    params: Mapping[str, Any],
    artifacts: Path,
) -> str:
    """Sign in, open the Dag, fill its trigger form with ``params``, screenshot it, submit; returns the new run_id.

    The screenshot of the filled form is ``artifacts/trigger-form.png`` (``artifacts/trigger-failure.png`` if a step
    fails). Params not given keep the form's defaults. The run_id is read from the URL the UI navigates to after
    the trigger, and cross-checked with the UI's own ``POST .../dagRuns`` answer, whose ``conf`` must equal what the
    form shows. If the Dag is paused, the dialog's default "Unpause <dag> on trigger" stays ticked.
    """
    artifacts.mkdir(parents=True, exist_ok=True)
    with browser_page(artifacts / "trigger-failure.png") as page:
        login(page, base_url, username, password, f"/dags/{dag_id}")
        dialog = open_trigger_form(page, dag_id)
        for name, value in params.items():
            _fill_param(page, dialog, name, value)
        page.screenshot(path=str(artifacts / "trigger-form.png"))

        with page.expect_response(_is_trigger_post(dag_id)) as answer:
            dialog.get_by_test_id("trigger-dag-submit").click()
        response = answer.value
        if not response.ok:
            detail = _error_detail(response)
            _refusal_alert(dialog, detail)
            page.screenshot(path=str(artifacts / "trigger-refused.png"))
            raise UIError(f"Airflow refused the trigger ({response.status}): {detail}")

        created = response.json()
        sent_conf = (response.request.post_data_json or {}).get("conf")
        for name, value in params.items():
            if sent_conf is None or sent_conf.get(name) != value:
                raise UIError(f"the form sent conf {sent_conf!r}, which does not have {name}={value!r}")

        run_path = re.compile(rf"/dags/{re.escape(dag_id)}/runs/(?P<run_id>[^/?#]+)")
        page.wait_for_url(run_path)
        match = run_path.search(page.url)
        assert match is not None  # wait_for_url matched it
        run_id = unquote(match["run_id"])
        if run_id != created["dag_run_id"]:
            raise UIError(f"the UI opened run {run_id!r} but Airflow created {created['dag_run_id']!r}")
        return run_id


def submit_invalid(
    base_url: str,
    username: str,
    password: str,
    dag_id: str,
    conf: Mapping[str, Any],
    artifacts: Path,
) -> str:
    """Trigger with ``conf`` typed into the dialog's "Configuration JSON" editor; returns Airflow's refusal as shown.

    The form's own widgets will not take an invalid value (the number field clamps to its minimum on blur, the
    dropdown only offers the enum), so this goes through "Advanced Options" -> "Configuration JSON", which a
    person can type anything into. Airflow's REST API validates the conf against the Dag's params and answers
    400; the dialog shows that answer in a red alert, which is screenshot to ``artifacts/trigger-refused.png``
    and returned as text (e.g. "400 Bad Request\\nInvalid input for param shutdown_timeout: -5 is less than the
    minimum of 0 ..."). ``UIError`` if Airflow accepted the run instead.
    """
    artifacts.mkdir(parents=True, exist_ok=True)
    with browser_page(artifacts / "refusal-failure.png") as page:
        login(page, base_url, username, password, f"/dags/{dag_id}")
        dialog = open_trigger_form(page, dag_id)
        dialog.get_by_role("button", name="Advanced Options").click()
        editor = dialog.locator(".monaco-editor")
        expect(editor).to_be_visible()
        editor.click()
        page.keyboard.press("ControlOrMeta+a")
        page.keyboard.press("Delete")
        page.keyboard.insert_text(json.dumps(dict(conf)))

        with page.expect_response(_is_trigger_post(dag_id)) as answer:
            dialog.get_by_test_id("trigger-dag-submit").click()
        response = answer.value
        sent_conf = (response.request.post_data_json or {}).get("conf")
        if sent_conf != dict(conf):
            raise UIError(f"the dialog sent conf {sent_conf!r} instead of {dict(conf)!r}")
        if response.ok:
            raise UIError(f"Airflow accepted conf {dict(conf)!r}: run {response.json().get('dag_run_id')!r}")

        alert = _refusal_alert(dialog, _error_detail(response))
        expect(dialog).to_be_visible()  # the dialog stays open on the error
        page.screenshot(path=str(artifacts / "trigger-refused.png"))
        return alert.inner_text().strip()


def _widen_grid_panel(page: Page, extra_px: int) -> None:
    """Drag the separator between the grid and the details panel ``extra_px`` to the right.

    By default the grid gets 20% of the width, which at 1400 px cuts off the newest (selected) run's column.
    """
    handle = page.get_by_role("separator").first
    panel = page.locator("#main-panel")
    if not (handle.count() and panel.count()):
        return  # another layout: keep it as it is
    box, before = handle.bounding_box(), panel.bounding_box()
    if box is None or before is None:
        return
    y = box["y"] + min(box["height"] / 2, 300)
    page.mouse.move(box["x"] + box["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(box["x"] + extra_px, y, steps=10)
    page.mouse.up()
    page.wait_for_function(
        "w => document.getElementById('main-panel').getBoundingClientRect().width > w",
        arg=before["width"] + extra_px / 2,
    )


def screenshot_grid(
    base_url: str,
    username: str,
    password: str,
    dag_id: str,
    run_id: str,
    path: Path,
    timeout: float = 300.0,
) -> str:
    """Wait (REST) until the run has finished, open its grid view in the UI and screenshot it; returns its state.

    The page is ``/dags/<dag_id>/runs/<run_id>``: the grid on the left (one cell per task,
    ``data-testid=grid-<run_id>-<task_id>``) and the run's header with its state badge on the right.
    """
    final = wait_for_run(base_url, username, password, dag_id, run_id, timeout=timeout)
    state = str(final["state"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with browser_page(path.with_name(f"{path.stem}-failure.png")) as page:
        login(page, base_url, username, password, f"/dags/{dag_id}/runs/{quote(run_id, safe='')}")
        header = page.get_by_test_id("header-card").filter(has_text=run_id)
        expect(header.get_by_test_id("state-badge").first).to_have_text(re.compile(state, re.IGNORECASE))
        _widen_grid_panel(page, GRID_PANEL_EXTRA_PX)
        expect(page.locator(f'[data-testid^="grid-{run_id}-"]').first).to_be_visible()
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(path))
    return state


def answer_in_ui(base_url: str, username: str, password: str, dag_id: str, run_id: str, task_id: str,
                 option: str, folder: Path) -> None:
    """Open the task's Required Actions review as a person does (from the task, once it waits for an answer), show
    its plan on a screenshot, press the option's button, check Airflow took the answer (the UI's PATCH of the
    task's hitlDetails succeeded), and screenshot the page after it."""
    with browser_page(folder / f"{task_id}-failure.png") as page:
        login(page, base_url, username, password,
              f"/dags/{dag_id}/runs/{quote(run_id, safe='')}/tasks/{task_id}/required_actions")
        button = page.get_by_role("button", name=option, exact=True)
        expect(button).to_be_enabled()
        page.screenshot(path=str(folder / f"{task_id}-asked.png"))
        with page.expect_response(lambda r: r.request.method == "PATCH" and "hitlDetails" in r.url) as sent:
            button.click()
        if not sent.value.ok:
            raise UIError(f"the answer {option!r} was refused: {_error_detail(sent.value)}")
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(folder / f"{task_id}-answered.png"))


def screenshot_view(base_url: str, username: str, password: str, path: str, expected: str, target: Path) -> str:
    """Open a page of the Changeover view (signed in, as from the UI's navigation), check it shows `expected`,
    screenshot it, and return its HTML (the timeline's lanes are SVG text)."""
    with browser_page(target.with_name(f"{target.stem}-failure.png")) as page:
        login(page, base_url, username, password, "/")
        page.goto(f"{base_url.rstrip('/')}{path}")
        expect(page.get_by_text(expected, exact=False).first).to_be_visible()
        page.screenshot(path=str(target), full_page=True)
        return page.content()
