"""Every failure a user can cause or meet, as one class each; `main` prints them as one `error:` line.

This module imports nothing of ours or of the heavy libraries, so every layer (options, data, model, training)
can raise these without pulling in another layer. `exit_code` is what the process exits with.
"""

from __future__ import annotations


class UserFacingError(Exception):
    """A failure with a message that says what happened and what to do: shown without a traceback."""

    exit_code = 2


class ConfigError(UserFacingError, ValueError):
    """A bad option or combination, caught before anything is loaded."""


class NeedsHardware(ConfigError):
    """An option that needs what this machine lacks (a GPU, bf16): `need` names the option ("--bf16", "FSDP"),
    so that several of them can be said together on the first line (ConfigErrors)."""

    def __init__(self, message: str, need: str):
        super().__init__(message)
        self.need = need


class ConfigErrors(ConfigError):
    """Every problem the checks found in one go (sft/options/checks.py runs them all), so that a run that cannot
    start says everything at once instead of one problem per try. The message is one `error:` line per problem,
    the first one first: a reader of the first line alone still learns what stops the run."""

    def __init__(self, problems: list[UserFacingError], lead: str | None = None):
        self.problems = list(problems)
        super().__init__("\nerror: ".join([*([lead] if lead else []), *(str(p) for p in self.problems)]))

    @classmethod
    def of(cls, problems: list[UserFacingError], lead: str | None = None) -> UserFacingError:
        """One problem as itself (its own class and message), several as one ConfigErrors."""
        return problems[0] if len(problems) == 1 and not lead else cls(problems, lead)


class DataError(UserFacingError, ValueError):
    """A record or file that cannot be read as training data; the message names the file and line."""


class ModelNotFoundError(UserFacingError):
    """`--model` (or `--tokenizer`) names nothing that can be loaded: a missing directory, an unknown or
    unreachable hub id."""


class RunLockedError(UserFacingError):
    """Another run holds the output directory."""


class DistributedCheckError(UserFacingError, RuntimeError):
    """The processes cannot communicate correctly; the message says what was seen and what to do."""


class NonFiniteError(UserFacingError, RuntimeError):
    """Training produced a NaN/inf loss or gradient."""

    exit_code = 1


class LossBrokeDown(UserFacingError, RuntimeError):
    """The logged loss stayed above --loss_watchdog_threshold for --loss_watchdog_patience logs in a row."""

    exit_code = 1


class SaveMismatchError(UserFacingError, RuntimeError):
    """The saved model does not reproduce the in-memory model."""

    exit_code = 1


class OutOfSpaceError(UserFacingError):
    """The output directory's disk (or quota) filled up while the run wrote to it; the message says what is kept and
    how to resume."""

    exit_code = 1


class UploadFailed(UserFacingError):
    """--push_to_hub's upload of the verified result failed (sft/safety/hub_push.py); every file is kept."""

    exit_code = 1


class Interrupted(UserFacingError):
    """Ctrl-C (SIGINT) or SIGTERM, e.g. the launcher ended: training stops at the next safe point."""

    exit_code = 130


class NothingToDo(UserFacingError):
    """The request is already done (a resumed run that reached its --max_steps): said without `error:`."""

    exit_code = 0


class LibraryMismatch(UserFacingError, RuntimeError):
    """An installed library is not what one of our overrides or patches of its private names was built for
    (sft/safety/private_names.py): stopped before relying on it, instead of going on without it."""
