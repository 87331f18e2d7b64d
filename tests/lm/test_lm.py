"""lm/: log-probs of given tokens, model-folder checks and weight payload round trips."""
import pytest
import torch

from lm.causal_lm import check_model_dir, load_causal_lm, pad_sequences, response_log_probs
from lm.weight_sync import WeightStore, load_weights_folder, resolve_weights, save_weights_folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    folder = tmp_path_factory.mktemp("model")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def test_response_log_probs_match_a_manual_forward_pass(model_dir):
    model = load_causal_lm(model_dir)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]]
    with torch.no_grad():
        lp, mask = response_log_probs(model, prompts, responses, temperature=0.7)
        assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]
        for row, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([p + r])).logits[0].float() / 0.7
            want = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) + len(r) - 1]
            want = want.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
            torch.testing.assert_close(lp[row, : len(r)], want, atol=1e-5, rtol=1e-5)
            assert torch.all(lp[row, len(r):] == 0)


def test_pad_sequences_shapes():
    ids, attention, mask, width = pad_sequences([[1], [2, 3]], [[4, 5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[1, 4, 5, 6], [2, 3, 7, 0]]
    assert attention.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert width == 3 and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_missing_model_folder_says_which_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_dir(tmp_path)


def test_weights_folder_round_trip_and_store(model_dir, tmp_path):
    state = load_causal_lm(model_dir).state_dict()
    folder = save_weights_folder(state, tmp_path / "v000003", version=3)
    version, loaded = load_weights_folder(folder)
    assert version == 3 and set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    again = resolve_weights({"version": 3, "kind": "folder", "path": str(folder)})
    assert torch.equal(again["model.embed_tokens.weight"], state["model.embed_tokens.weight"])

    store = WeightStore()
    assert store.latest_version() == -1 and store.latest() is None
    store.publish({"version": 3, "kind": "folder", "path": str(folder)})
    with pytest.raises(ValueError, match="backwards"):
        store.publish({"version": 2, "kind": "folder", "path": str(folder)})
    assert store.latest_version() == 3


def test_unknown_payload_kind_is_refused():
    with pytest.raises(ValueError, match="unknown weight payload kind"):
        resolve_weights({"version": 1, "kind": "carrier-pigeon"})
