"""The pipeline's one way to its rollout servers: a :class:`~asyncexec.Router` (sticky sessions,
health, retries), the user's or a default one over an executor of servers, which the pipeline
enters and leaves. Everything the pipeline asks of the servers goes through :class:`Servers`."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal

from ..._dispatch._role import method
from ..._errors import ConfigurationError
from ..._wire._rollout import RolloutRequest, Sample
from ..._worker import RolloutServer
from .._executor import Executor
from ._router import Router

if TYPE_CHECKING:
    from ..channel import WeightChannel

__all__ = ["Servers", "servers_of"]


class Servers:
    """Requests, pauses and installs on the rollout servers of ``router`` (entered by the
    pipeline, through :meth:`held`, when ``owned``)."""

    def __init__(self, router: Router, *, owned: bool) -> None:
        self.executor = router.servers
        self.router = router
        #: The router's name (the ``router`` label of the pipeline's metrics).
        self.name = router.name
        self.owned = owned
        self.cls = router.methods.cls
        #: Whether a "keep" update leaves the servers generating (each holds its generation
        #: for its own load: ``RolloutServer.pauses_for_its_loads``).
        self.keep_without_pause = self.cls.pauses_for_its_loads()

    def held(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """What the pipeline enters for its servers: the router when it is the pipeline's own,
        else nothing (the user's router is the user's to enter and leave)."""
        return self.router if self.owned else contextlib.nullcontext()

    async def turn(self) -> None:
        """Until a request may start in this turn of the event loop (the router's pacing of
        bursts: an admission of many prompts spreads over turns as the router's sends do)."""
        await self.router.pacer.wait_turn()

    async def generate(self, request: RolloutRequest) -> Sample:
        """The sample of ``request`` (an idempotent request: sent again when its server dies;
        cancelled, it stops on its server)."""
        return await self.router.generate_stoppable(request, retry=True)

    async def pause(self, mode: Literal["keep", "abort"]) -> int:
        return await self.router.pause(mode)

    async def resume(self) -> None:
        await self.router.resume()

    async def install(self, state: Any, version: int) -> None:
        """Install ``state`` as ``version`` on every server (no weight channel)."""
        await self.executor.call(method(self.cls, "install_weights"), state, version)


def servers_of(target: Any, channel: WeightChannel | None) -> Servers:
    """The servers behind ``target``: a Router, or an Executor of rollout servers (behind a
    default Router of the pipeline's, which rejoins a replaced server at ``channel``'s
    version).

    Raises:
        ConfigurationError: ``target`` is neither (or an executor without exactly one role
            that subclasses RolloutServer).
    """
    if isinstance(target, Executor):
        _check_servers(target)  # (before the Router's check, which speaks of a Router)
        return Servers(Router(target, channel=channel), owned=True)
    if isinstance(target, Router):
        return Servers(target, owned=False)
    raise ConfigurationError(
        f"a Pipeline takes an asyncexec.Router or an Executor of rollout servers, got {target!r}"
    )


def _check_servers(executor: Executor) -> None:
    found = [r.cls for r in executor.config.roles if issubclass(r.cls, RolloutServer)]
    if len(found) != 1:
        raise ConfigurationError(
            "a Pipeline's servers are an executor with one role that subclasses "
            f"asyncexec.RolloutServer; {executor.config.name!r} has {len(found)}"
        )
