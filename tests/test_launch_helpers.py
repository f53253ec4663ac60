"""The launch tests' own helpers: what a failed launch shows in the test's message."""

from horovod_launch import excerpt, horovod_own_failure


def test_excerpt_keeps_the_cause_logged_before_the_first_traceback():
    # Horovod logs its background loop's failure once, then every rank raises "shut down":
    # the cause lies before the first traceback, which a plain head-and-tail excerpt drops.
    cause = "[2]<stderr>:[ERROR] Horovod background loop uncaught exception: Timed out"
    shut = "Traceback (most recent call last):\nRuntimeError: Horovod has been shut down.\n"
    stderr = "[0]<stderr>:warming up\n" * 50 + cause + "\n" + shut * 400
    text = excerpt(stderr, chars=1000)
    assert cause in text
    assert "warming up" not in text  # only the lines that name a cause, not everything before
    assert text.count("Traceback") >= 2  # the first traceback and the end


def test_excerpt_of_a_short_stderr_is_all_of_it():
    assert excerpt("boom\n", chars=1000) == "boom\n"


SHUT = (
    "RuntimeError: Horovod has been shut down. This was caused by an exception on one of the ranks"
)
LAUNCHER = "RuntimeError: Horovod detected that one or more processes exited with non-zero status"


def test_a_failure_inside_horovod_alone_is_told_apart():
    loop = "[1]<stderr>:[ERROR] Horovod background loop uncaught exception: Connection closed"
    internal = "horovod.common.exceptions.HorovodInternalError: Horovod has been shut down."
    stderr = "\n".join([loop, f"[0]<stderr>:{SHUT}", f"[1]<stderr>:{internal}", LAUNCHER])
    assert horovod_own_failure(stderr) == loop
    # Without the loop's log line the shutdowns alone still name it.
    assert "shut down" in horovod_own_failure(f"[0]<stderr>:{SHUT}\n{LAUNCHER}")


def test_a_failure_of_the_library_or_the_test_is_not_relaunched():
    ours = "[2]<stderr>:ValueError: slow_lr must be positive"
    assert horovod_own_failure("\n".join([ours, f"[0]<stderr>:{SHUT}", LAUNCHER])) is None
    assert horovod_own_failure("[0]<stderr>:AssertionError: ranks differ\n" + LAUNCHER) is None
    assert horovod_own_failure("Killed\n") is None  # nothing raised: not Horovod's shutdown
