"""The SDK's calls that can wake a suspended sandbox (a command, a files call) wait for the
server's wake bound on top of their own timeout. Before, a files call's read timeout was the
request timeout alone (60 s, as long as the server's whole wake), and a command's its run
plus 30 s: a wake longer than that was reported as "cannot reach the API".

Scaled: a request timeout of one second, and a wake held three seconds (the resumed
generation's launch held in the fake driver), through the same code as 60 s and longer."""

from __future__ import annotations

import sys

import apikit
from apikit import unique

from drivers.fake import FakeDriver
from services.common.settings import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "sdk" / "python"))  # the SDK as a user has it

from sandstream_sdk import AsyncSandbox
from sandstream_sdk.errors import NotReadyError, UnavailableError

REQUEST_TIMEOUT = 1.0
WAKE_HELD = 3 * REQUEST_TIMEOUT


async def test_a_files_call_waits_out_a_wake_longer_than_its_request_timeout() -> None:
    driver = FakeDriver()
    async with apikit.running_api(driver) as api, api.client() as c:
        name = unique("sdkwake")
        await apikit.suspended(c, name)
        sb = await AsyncSandbox.connect(
            name, auto_resume=False, api_url=api.url, token=apikit.ADMIN,
            request_timeout=REQUEST_TIMEOUT,
        )  # fmt: skip
        try:
            reading = sb.files.read("/workspace/f")
            try:
                await apikit.during_a_held_wake(driver, name, reading, WAKE_HELD)
                raise AssertionError("the fake driver's sandboxes have no runtime to read")
            except UnavailableError as exc:  # the old read timeout
                raise AssertionError(f"the call gave up during the wake: {exc}") from exc
            except Exception as exc:  # past the wake, at the runtime
                assert "runtime is not running" in str(exc), exc
        finally:
            await sb.close()


async def test_a_streamed_read_waits_out_the_wake_and_raises_before_any_byte() -> None:
    """``files.read_stream`` is the same call as ``read``: it waits out the wake, and the
    answer after it (an error here) is raised by its ``async with``, before any chunk."""
    driver = FakeDriver()
    async with apikit.running_api(driver) as api, api.client() as c:
        name = unique("sdkwakestream")
        await apikit.suspended(c, name)
        sb = await AsyncSandbox.connect(
            name, auto_resume=False, api_url=api.url, token=apikit.ADMIN,
            request_timeout=REQUEST_TIMEOUT,
        )  # fmt: skip

        async def stream() -> None:
            async with sb.files.read_stream("/workspace/f"):
                raise AssertionError("the block runs only once the API answered 200")

        try:
            await apikit.during_a_held_wake(driver, name, stream(), WAKE_HELD)
            raise AssertionError("the fake driver's sandboxes have no runtime to read")
        except UnavailableError as exc:  # the old read timeout
            raise AssertionError(f"the call gave up during the wake: {exc}") from exc
        except NotReadyError as exc:  # past the wake, at the runtime
            assert "runtime is not running" in str(exc), exc
        finally:
            await sb.close()
