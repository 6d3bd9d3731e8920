"""How a rank's failure reaches the user: one ``error:`` line, from the launcher.

Bad input found before any rank starts is the preflight check's (``preflight.py``).
Some is only found once the ranks run: a memory budget no plan fits, a plan cache
of another job. A rank then stops with exit status 2; torchrun used to end the job
with its own ``ChildFailedError`` traceback and a report per rank, under which the
rank's one line was lost (and with ``LOG_RANK`` showing another rank, not shown).

So each side does its part:

* the rank (``record_user_error``) writes its message to the error file torchrun
  gives every worker (``TORCHELASTIC_ERROR_FILE``), in the format torchrun reads
  back, and leaves the printing to our launcher when that launched it;
* the launcher (``report``) turns torchrun's ``ChildFailedError`` into the rank's
  line and the rank's exit status. A crash (any other status, or a signal) is
  named the same way, with the rank's recorded traceback when ``LOG_RANK`` hid
  that rank's output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from typing import TYPE_CHECKING

from torchtitan_autoparallel.mesh.runtime import ranks_that_never_arrived

if TYPE_CHECKING:  # torch's elastic package is imported only where a job runs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

NO_RECORD = "<NONE>"  # torchrun's message where a rank wrote no error file
USER_ERROR_EXIT = 2  # a rank's status for bad input (``main.py``), as the preflight's
INTERRUPTED_EXIT = 128 + 2  # the shell's status for a job stopped by Ctrl-C (SIGINT)
LAUNCHER_ENV = "TORCHTITAN_AUTOPARALLEL_LAUNCHER"  # set by ``launch.py`` for its ranks
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each worker
_TIMED_OUT = "timed out"  # gloo's and NCCL's words for a collective past its timeout
TIMEOUT_HINT = (
    "a collective timed out: another rank is stuck, died or is far slower, or the "
    "limit is too short; comm.init_timeout_seconds holds until the first step is done, "
    "comm.train_timeout_seconds after it"
)
STALLED_EXIT = 1  # a rank's status when its collective timed out waiting for named ranks
STALLED_KEY = "never_arrived"  # the error file's list of those ranks (``name_stalled_ranks``)
# gloo's words for a peer that went away mid-collective: a consequence of that peer's own end
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe")
LOST_PEER_KEY = "lost_peer"  # the error file's mark of such a failure (``explain_collective_failure``)
# how long such a rank stays before exiting: torchrun's agent, which looks every 0.1 s and
# reports the first failed rank it finds, then sees the peer's end first and names it
LOST_PEER_WAIT_S = 3.0
# SIGKILL is the one signal a rank cannot catch, so it leaves no message; on a
# training host it is almost always the kernel's out-of-memory killer.
KILLED_HINT = "most often the out-of-memory killer: the host or the job's memory limit is too small"


def record_user_error(message: str) -> None:
    """On a rank: make ``message`` the rank's reported failure; print it unless our
    launcher will (then it is printed once, not once per shown rank)."""
    # torchrun's reader takes a plain string message with a top-level timestamp
    _record(message, {})


def explain_collective_failure(error: BaseException) -> int | None:
    """On a rank: a collective that lost a peer, or timed out waiting for ranks that never
    came (``name_stalled_ranks``), ends in one recorded line and an exit status, no
    traceback; None for any other error. A lost peer is the consequence of that peer's
    end (killed, crashed): the launcher names that rank (``root_cause``), not this one."""
    found = [x for x in _LOST_PEER if x in str(error).lower()]
    if not found:
        return name_stalled_ranks(error)
    rank = os.environ.get("RANK", "0")
    _record(f"rank {rank} lost its connection to another rank in a collective ({found[0]}): that rank ended "
            "first, and its end is the cause", {LOST_PEER_KEY: True})
    if os.environ.get(LAUNCHER_ENV):
        time.sleep(LOST_PEER_WAIT_S)  # the agent stops this rank meanwhile, once it sees the peer's end
    return 1


def name_stalled_ranks(error: BaseException) -> int | None:
    """On a rank: for a collective that timed out, record one line naming the ranks
    that never reached one (``runtime.ranks_that_never_arrived``) and return the exit
    status; None for any other error, or when every rank got there (then nothing
    points at one rank: the error goes on as it is)."""
    if _TIMED_OUT not in str(error).lower():
        return None
    missing = ranks_that_never_arrived()
    if not missing:
        return None
    rank = int(os.environ.get("RANK", "0"))
    _record(stalled_message(missing, rank, _waited_s(str(error))), {STALLED_KEY: missing})
    return STALLED_EXIT


def stalled_message(missing: list[int], rank: int, waited_s: float | None) -> str:
    """One line: the ranks that never arrived first, then how that was seen."""
    who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}"
    waited = f" {waited_s:g} s" if waited_s is not None else ""
    return (
        f"{who} stopped responding: {'it' if len(missing) == 1 else 'they'} never reached the collective "
        f"that rank {rank} waited{waited} in until it timed out; find what holds "
        f"{who} (LOG_RANK={missing[0]} shows its output, kill -USR1 on its process prints its stack), or if it "
        "is only slower raise comm.train_timeout_seconds (comm.init_timeout_seconds until the first step is done)"
    )


def _waited_s(text: str) -> float | None:
    """The wait a timeout message states (gloo: 'Timed out waiting 3000ms')."""
    found = re.search(r"waiting (\d+)\s*ms", text)
    return int(found.group(1)) / 1000 if found else None


def _record(message: str, extra: dict) -> None:
    """``record_user_error``'s, with ``extra`` fields for our launcher in the error file."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time()), **extra}, f)
    if not (path and os.environ.get(LAUNCHER_ENV)):
        print(f"error: {message}", file=sys.stderr)


def report(error: ChildFailedError, shown_ranks: set[int] | None) -> int:
    """Print one ``error:`` line for a failed job; the exit status to end with.
    ``shown_ranks``: the ranks whose output the user saw (None: all of them)."""
    rank, failure = root_cause(error.failures)
    if failure.error_file_data.get(STALLED_KEY) and _recorded(failure):  # names the ranks at fault itself
        print(f"error: {_message(failure)}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    if failure.exitcode == USER_ERROR_EXIT and _recorded(failure):
        print(f"error: {_message(failure)}", file=sys.stderr)
        return USER_ERROR_EXIT
    hidden = shown_ranks is not None and failure.local_rank not in shown_ranks
    callstack = _callstack(failure)
    if hidden and callstack:
        print(f"rank {rank}'s traceback (its output is not shown):\n{callstack}", file=sys.stderr)
    print(f"error: {describe(rank, failure, hidden)}", file=sys.stderr)
    return failure.exitcode if failure.exitcode > 0 else 1


def report_signal(signal_name: str, signum: int) -> int:
    """The launcher was stopped (Ctrl-C, a scheduler's SIGTERM): torchrun has stopped the
    ranks already; one line instead of its traceback."""
    print(f"stopped: the launcher received {signal_name}; every rank was stopped", file=sys.stderr)
    return 128 + signum


def root_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The rank that failed first. Ranks ended by a signal are only a root cause when
    nothing else failed: the agent stops every other rank with SIGTERM once one fails,
    and error-file timestamps are whole seconds, so they tie with those ranks'. For the
    same reason a rank that died of another signal (an abort, a segfault, the
    out-of-memory killer's SIGKILL) comes before those the agent stopped, and before
    ranks whose collective lost that rank as a peer (they fail at once, often first)."""
    return min(failures.items(), key=lambda item: (_stopped_by(item[1]), item[1].timestamp,
                                                   not _recorded(item[1]), item[0]))


def _stopped_by(failure: ProcessFailure) -> int:
    """0: the rank failed itself; 1: a signal ended it; 2: a peer's end did (a lost
    connection); 3: the agent's SIGTERM did."""
    if failure.exitcode >= 0:
        lost = failure.error_file_data.get(LOST_PEER_KEY) or any(x in _message(failure).lower() for x in _LOST_PEER)
        return 2 if lost else 0
    return 3 if failure.exitcode == -signal.SIGTERM else 1


def describe(rank: int, failure: ProcessFailure, hidden: bool) -> str:
    if failure.exitcode < 0:
        what = f"rank {rank} was killed by {failure.signal_name()}"
        if failure.signal_name() == "SIGKILL" and not _recorded(failure):
            what += f" ({KILLED_HINT})"
    else:
        what = f"rank {rank} failed with exit status {failure.exitcode}"
    if _recorded(failure):
        message = _message(failure).splitlines()[0]
        what += f": {message}"
        if _TIMED_OUT in message.lower():
            what += f" ({TIMEOUT_HINT})"
    if hidden:
        what += f" (its output is hidden: LOG_RANK={failure.local_rank} shows it)"
    return what


def _recorded(failure: ProcessFailure) -> bool:
    """Whether the rank wrote its failure (torchrun makes up a message otherwise)."""
    return bool(_message(failure))


def _message(failure: ProcessFailure) -> str:
    """The recorded message: ours is a string, torch's ``record`` nests it in a dict."""
    message = failure.error_file_data.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    text = str(message or "").strip()
    return "" if text == NO_RECORD else text


def _callstack(failure: ProcessFailure) -> str:
    message = failure.error_file_data.get("message")
    if isinstance(message, dict):  # torch's ``record`` writes the traceback here
        return str(message.get("extraInfo", {}).get("py_callstack", "")).rstrip()
    return ""


def shown_ranks(torchrun_args: list[str]) -> set[int] | None:
    """The local ranks ``--local-ranks-filter`` shows (None: every rank's output)."""
    value = ranks_filter(torchrun_args)
    return None if value is None else {int(r) for r in value.split(",") if r.strip()}


def ranks_filter(torchrun_args: list[str]) -> str | None:
    """``--local-ranks-filter``'s value as given (``LOG_RANK``); None where it is not."""
    for i, arg in enumerate(torchrun_args):
        if arg.startswith("--local-ranks-filter"):
            return arg.partition("=")[2] if "=" in arg else torchrun_args[i + 1]
    return None
