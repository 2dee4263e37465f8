"""A tiny random Llama in Hugging Face format, for serving demos and tests (vLLM loads it offline).

:func:`make_tiny_model` writes a ``transformers`` ``LlamaForCausalLM`` with seeded random weights
(safetensors) and a word-level tokenizer (``tokenizers``; ``PreTrainedTokenizerFast``) with a chat
template into one directory, so ``vllm serve DIR`` and ``/v1/chat/completions`` work with
``HF_HUB_OFFLINE=1`` and no download. The shapes fit vLLM's CPU attention (head size 64, within its
32-256 range) and leave room for long multi-turn prompts (4096 positions).

transformers and tokenizers are imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
import os

from ascend_dualpath.errors import ConfigError

# Special tokens first, so their ids are stable (0..6) whatever the word list holds.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, *ROLE_TOKENS)

PUNCTUATION = tuple(".,;:!?'\"()-/&%$#@*+=")

# A fixed list of common English words: enough for readable prompts; numbers fill the rest of the vocabulary.
WORDS = tuple(
    """
    the of and to a in is it you that he was for on are with as i his they be at one have this from or had by
    hot word but what some we can out other were all there when up use your how said an each she which do their
    time if will way about many then them write would like so these her long make thing see him two has look
    more day could go come did number sound no most people my over know water than call first who may down side
    been now find any new work part take get place made live where after back little only round man year came
    show every good me give our under name very through just form sentence great think say help low line differ
    turn cause much mean before move right boy old too same tell does set three want air well also play small end
    put home read hand port large spell add even land here must big high such follow act why ask men change went
    light kind off need house picture try us again animal point mother world near build self earth father head
    stand own page should country found answer school grow study still learn plant cover food sun four between
    state keep eye never last let thought city tree cross farm hard start might story saw far sea draw left late
    run don't while press close night real life few north open seem together next white children begin got walk
    example ease paper group always music those both mark often letter until mile river car feet care second book
    carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch color
    face wood main enough plain girl usual young ready above ever red list though feel talk bird soon body dog
    family direct pose leave song measure door product black short numeral class wind question happen complete
    ship area half rock order fire south problem piece told knew pass since top whole king space heard best hour
    better true during hundred five remember step early hold west ground interest reach fast verb sing listen six
    table travel less morning ten simple several vowel toward war lay against pattern slow center love person
    money serve appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead
    cry dark machine note wait plan figure star box noun field rest correct able pound done beauty drive stood
    contain front teach week final gave green oh quick develop ocean warm free minute strong special mind behind
    clear tail produce fact street inch multiply nothing course stay wheel full force blue object decide surface
    deep moon island foot system busy test record boat common gold possible plane stead dry wonder laugh thousand
    ago ran check game shape equate miss brought heat snow tire bring yes distant fill east paint language among
    grand ball yet wave drop heart am present heavy dance engine position arm wide sail material size vary settle
    speak weight general ice matter circle pair include divide syllable felt perhaps pick sudden count square
    reason length represent art subject region energy hunt probable bed brother egg ride cell believe fraction
    forest sit race window store summer train sleep prove lone exercise wall catch mount wish sky board joy winter
    sat written wild instrument kept glass grass cow job edge sign visit past soft fun bright gas weather month
    million bear finish happy hope flower clothe strange gone jump baby eight village meet root buy raise solve
    metal whether push seven paragraph third shall held hair describe cook floor either result burn hill safe cat
    century consider type law bit coast copy phrase silent tall sand soil roll temperature finger industry value
    fight lie beat excite natural view sense ear else quite broke case middle kill son lake moment scale loud
    spring observe child straight consonant nation dictionary milk speed method organ pay age section dress cloud
    surprise quiet stone tiny climb cool design poor lot experiment bottom key iron single stick flat twenty skin
    smile crease hole trade melody trip office receive row mouth exact symbol die least trouble shout except wrote
    seed tone join suggest clean break lady yard rise bad blow oil blood touch grew cent mix team wire cost lost
    brown wear garden equal sent choose fell fit flow fair bank collect save control decimal gentle woman captain
    practice separate difficult doctor please protect noon whose locate ring character insect caught period
    indicate radio spoke atom human history effect electric expect crop modern element hit student corner party
    supply bone rail imagine provide agree thus capital won't chair danger fruit rich thick soldier process operate
    guess necessary sharp wing create neighbor wash bat rather crowd corn compare poem string bell depend meat rub
    tube famous dollar stream fear sight thin triangle planet hurry chief colony clock mine tie enter major fresh
    search send yellow gun allow print dead spot desert suit current lift rose continue block chart hat sell
    success company subtract event particular deal swim term opposite wife shoe shoulder spread arrange camp
    invent cotton born determine quart nine truck noise level chance gather shop stretch throw shine property
    column molecule select wrong gray repeat require broad prepare salt nose plural anger claim continent oxygen
    sugar death pretty skill women season solution magnet silver thank branch match suffix especially fig afraid
    huge sister steel discuss forward similar guide experience score apple bought led pitch coat mass card band
    rope slip win dream evening condition feed tool total basic smell valley nor double seat arrive master track
    parent shore division sheet substance favor connect post spend chord fat glad original share station dad bread
    charge proper bar offer segment slave duck instant market degree populate chick dear enemy reply drink occur
    support speech nature range steam motion path liquid log meant quotient teeth shell neck hello hi thanks mat
    """.split()
)


@dataclasses.dataclass(frozen=True)
class TinyHFConfig:
    """Shapes of the tiny Llama; the defaults fit vLLM's CPU attention and block size 32.

    ``dtype`` bfloat16: on this machine's vLLM CPU backend (AMX) it decodes 4 x 24 greedy tokens in 0.10 s
    against 3.7 s in float32, and repeated runs give the same tokens. ``init_std`` is the std of the normal
    weight init: larger than Llama's 0.02 so that the logits of a random model spread out and greedy
    decoding does not settle on one repeated token at once.
    """

    vocab_size: int = 1088
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    init_std: float = 0.08
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        head_dim = self.hidden_size // self.num_heads
        if not 32 <= head_dim <= 256:
            raise ConfigError(f"head size {head_dim} (hidden_size/num_heads) is outside vLLM CPU's 32..256")
        if self.vocab_size < len(vocabulary_words()):
            raise ConfigError(f"vocab_size={self.vocab_size} is below the {len(vocabulary_words())} fixed tokens")
        if self.dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"dtype={self.dtype!r} is neither 'bfloat16' nor 'float32'")


# A plain role-tagged transcript; ends with the assistant tag when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocabulary_words() -> list[str]:
    """The fixed tokens in id order: special tokens, punctuation, then the word list (no duplicates)."""
    tokens: list[str] = []
    for token in (*SPECIAL_TOKENS, *PUNCTUATION, *WORDS):
        if token not in tokens:
            tokens.append(token)
    return tokens


def vocabulary(size: int) -> dict[str, int]:
    """Token -> id for ``size`` ids: the fixed tokens, then the numbers 0, 1, ... up to ``size``."""
    tokens = vocabulary_words()
    number = 0
    while len(tokens) < size:
        if str(number) not in tokens:
            tokens.append(str(number))
        number += 1
    return {token: index for index, token in enumerate(tokens[:size])}


def build_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast``: lower-cased words and punctuation, unknown words -> ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocabulary(vocab_size), unk_token=UNK))
    core.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's decoder joins words with spaces and removes the space before punctuation (cleanup).
    core.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _llama_config(cfg: TinyHFConfig, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        torch_dtype=cfg.dtype,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def make_tiny_model(directory: str | os.PathLike, cfg: TinyHFConfig | None = None) -> str:
    """Write the tiny model (config, safetensors weights, tokenizer, chat template) into ``directory``.

    The same ``cfg`` (seed included) writes the same weights. Returns the directory as a string.
    """
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    cfg = cfg or TinyHFConfig()
    out = os.fspath(directory)
    os.makedirs(out, exist_ok=True)
    tokenizer = build_tokenizer(cfg.vocab_size)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(_llama_config(cfg, tokenizer)).to(getattr(torch, cfg.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
