"""A run's conversation, decided once before any weights load: the environment made and checked, the chat template
checked against its tools, the renderer built (prompts with the tools' schemas, observations as token ids), and the
chat prompts rendered as they will be trained on. The one way the trainer, `ppokit plan` and `ppokit data inspect
--config` render a run's prompts (`conversation_for`), so that their token counts agree."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ppokit.conversation.renderer import ConversationRenderer
from ppokit.errors import UserError


@dataclass
class Conversation:
    """How a run's episodes are rendered and answered, decided before any weights load (`conversation_setup`):
    the renderer (prompts with the tools' schemas, observations as token ids), the environment's runner (None
    without one), and the chat template used (None: plain-text prompts)."""

    renderer: ConversationRenderer
    runner: Any = None
    template: Optional[str] = None
    agent: Any = None  # the agent program (`environments.agent.AgentRunner`), None without one

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """What ends a model turn, decided at start-up (ppo.stop_token, and a tool-calling turn's own token where the
        template ends it with another: `ConversationRenderer.check`): every purpose's sampling reads it."""
        return self.renderer.stop_token_ids


def conversation_setup(tokenizer, *, chat_template: Optional[str], template_kwargs: Optional[dict], datasets: list,
                       environment: Optional[str], environment_args: dict, timeout_s: Optional[float], max_turns: int,
                       stop_token: Optional[str] = None, stop_token_id: Optional[int] = None, base_dir=None,
                       say=lambda message: None, agent: Optional[dict] = None) -> Conversation:
    """The run's conversation, checked, and its chat prompts rendered (every `datasets` entry, None skipped): the
    environment is made (one instance, its arguments checked; it gets the template as `chat_template` if its
    constructor declares it), the renderer built with its tools, every rendering the episodes will need tried once
    (`ConversationRenderer.check`), then the prompts rendered with the tools' schemas. Every failure is one UserError
    line. chat_template: data.chat_template as configured; template_kwargs: data.chat_template_kwargs; stop_token,
    stop_token_id: ppo.stop_token / ppo.stop_token_id (`models.resolve_stop_token`; the conversation's `stop_token_ids`
    may add a tool-calling turn's own). agent: the agent program's keys (`spec`, `timeout_s`, `call_timeout_s`,
    `tool_parser`; None: no agent): its calls are chat messages, so the chat template is resolved whatever the prompts,
    checked with a `tool` observation, and the tool-call format decided."""
    from ppokit.conversation.templates import Renderer, resolve_chat_template
    from ppokit.environments.base import EnvironmentRunner
    from ppokit.models.loading import resolve_stop_token

    stop_token_ids = resolve_stop_token(tokenizer, stop_token, stop_token_id)
    datasets = [d for d in datasets if d is not None]
    chat_prompts = any(d.chat is not None for d in datasets)
    template = resolve_chat_template(tokenizer, chat_template) if chat_prompts or agent is not None else None
    runner = None
    if environment is not None:
        runner = EnvironmentRunner.from_config(environment, environment_args, timeout_s, base_dir, chat_template=template)
        for note in runner.notes:
            say(note)
        if runner.tools and template is None:
            raise UserError(f"environment {environment}: its tools reach the model as schemas the chat template writes into the "
                            f"prompt, and the prompts{' of ' + datasets[0].source if datasets else ''} are plain text; use chat prompts (a `messages` "
                            "column, or prompts as lists of messages) or, if the prompt text describes the tools itself, "
                            "environment_args.tool_schemas: none")
    chat = Renderer(tokenizer, template, tools=runner.tools if runner else None, template_kwargs=template_kwargs) if template is not None else None
    role = runner.observation_role if runner else ("tool" if agent is not None else "user")
    renderer = ConversationRenderer(tokenizer, chat, stop_token_ids=stop_token_ids, observation_role=role, say=say)
    agent_runner = _agent(agent, renderer, template, max_turns, base_dir) if agent is not None else None
    if runner is not None:
        renderer.check(needs_tools=bool(runner.tools), max_turns=max_turns, what=f"environment {environment}")
        if renderer.first_observation_problem and not runner.reset_appends:
            say(renderer.first_observation_problem)
    for dataset in datasets:
        dataset.render_chat(renderer, rows_tools(runner, dataset))
    return Conversation(renderer, runner, template, agent_runner)


def rows_tools(runner, dataset) -> Optional[list]:
    """Each row's tools, when the environment's rows choose among several (`EnvironmentRunner.tools_for`), every row's
    choice checked now: a row that chooses none is one line naming it, before any weights load. None: every prompt
    shows the environment's tools (or none)."""
    if runner is None or not runner.chooses_per_row:
        return None
    tools = []
    for i in range(len(dataset)):
        try:
            tools.append(runner.tools_for(dataset.row(i)))
        except UserError as e:
            raise UserError(f"{dataset.where(i)}: {e}") from None
    return tools


def conversation_for(config, tokenizer, datasets: list, say: Callable[[str], None] = lambda message: None,
                     base_dir: Optional[Path] = None) -> Conversation:
    """The conversation of a PPO `config` (`conversation_setup` with its keys: data.chat_template and its kwargs, the
    environment and its tools, rollout.max_turns, ppo.stop_token), its chat prompts in `datasets` (`prompts.PromptDataset`,
    None skipped) rendered as they are trained on, tools' schemas included. The one way the trainer, `ppokit plan` and
    `ppokit data inspect --config` render a run's prompts, so that their token counts agree. base_dir: where tool files
    are looked up (default: the working directory)."""
    return conversation_setup(
        tokenizer, chat_template=config.data.chat_template, template_kwargs=config.data.chat_template_kwargs, datasets=datasets,
        environment=config.environment, environment_args=config.environment_args, timeout_s=config.environment_timeout_s,
        max_turns=config.rollout.max_turns, stop_token=config.ppo.stop_token, stop_token_id=config.ppo.stop_token_id,
        base_dir=base_dir if base_dir is not None else Path.cwd(), say=say,
        agent=None if config.agent is None else dict(spec=config.agent, timeout_s=config.agent_timeout_s,
                                                     call_timeout_s=config.agent_call_timeout_s, tool_parser=config.agent_tool_parser))


def _agent(keys: dict, renderer: ConversationRenderer, template: str, max_turns: int, base_dir):
    """The agent program loaded and its renderings tried once (a tool message after a turn; the stop tokens decided), its
    tool-call format resolved (`agent_tool_parser`), before the chat prompts are rendered (without tools: the agent
    names its own per call)."""
    from ppokit.environments.agent import AgentRunner
    from ppokit.environments.tool_parsers import resolve_parser

    program = AgentRunner.load(keys["spec"], base_dir)
    renderer.check(needs_tools=False, max_turns=max(max_turns, 2), what=f"agent {program.spec}")
    parser, note = resolve_parser(keys["tool_parser"], template, where="agent_tool_parser")
    if note:
        renderer.say(note)
    if max_turns == 1:  # the default: an agent's second call would be refused (400), which a tool loop does not expect
        renderer.say(f"agent {program.spec}: rollout.max_turns is 1, so each episode's agent gets one call answered (a second is "
                     "refused); set rollout.max_turns to the calls an episode may make")
    return AgentRunner(program, timeout_s=keys["timeout_s"], call_timeout_s=keys["call_timeout_s"], parser=parser,
                       renderer=renderer)
