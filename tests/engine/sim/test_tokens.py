"""The simulated model's token chain: deterministic, request-specific, ended as configured."""

from __future__ import annotations

from engine.sim.tokens import EOS, SEED, advance, choice, continuation, states, text_of


def test_states_chain_from_the_seed_and_continue_from_any_point() -> None:
    tokens = [104, 105, 33, 10, 257]
    whole = states(tokens, 0, SEED)
    assert states(tokens[2:], 2, whole[1]) == whole[2:]
    assert whole[0] == advance(SEED, 104, 0)
    assert all(0 <= state < 2**31 for state in whole)


def test_a_continuation_depends_on_every_prompt_token_and_its_position() -> None:
    prompt = list(b"The quick brown fox")
    answer = continuation(prompt, 50, 0)
    assert len(answer) == 50 and continuation(prompt, 50, 0) == answer
    assert continuation([*prompt[:-1], ord("X")], 50, 0) != answer
    assert continuation([ord("A"), *prompt[1:]], 50, 0) != answer
    assert set(answer) <= set(b"abcdefghijklmnopqrstuvwxyz .")


def test_answers_end_about_once_in_mean_output_tokens_unless_eos_is_ignored() -> None:
    lengths = [len(continuation(list(f"prompt {i}".encode()), 2000, 50)) for i in range(300)]
    assert 30 < sum(lengths) / len(lengths) < 75
    ended = next(list(f"prompt {i}".encode()) for i, n in enumerate(lengths) if n < 2000)
    assert continuation(ended, 2000, 50)[-1] == EOS
    kept_going = continuation(ended, 2000, 50, ignore_eos=True)
    assert len(kept_going) == 2000 and kept_going.count(EOS) > 1
    stopped = continuation(ended, 2000, 50)
    assert kept_going[:len(stopped)] == stopped
    assert text_of(kept_going) == bytes(t for t in kept_going if t != EOS).decode()


def test_the_fallback_letter_is_what_follows_when_the_end_is_banned() -> None:
    state = next(s for s in range(10**6) if choice(s, 16).token == EOS)
    picked = choice(state, 16)
    assert picked.letter != EOS and choice(state, 0).token == picked.letter
