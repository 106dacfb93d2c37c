// SentencePiece tokenizer for moe/tokenizer.h: a thin C wrapper over
// libsentencepiece's C++ API (SentencePieceProcessor, SentencePieceTrainer).
// C++ exceptions (std::bad_alloc, anything else) stop here: every entry point
// catches all and returns an MOE_E* code with a message, as the C code expects.
#include "moe/src/tokenizer_spm.h"
#include "moe/error.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

// Exported by libsentencepiece (common.h, not installed): its LOG(INFO/ERROR)
// lines go to stderr, and library code of moe never prints.
namespace sentencepiece {
namespace logging {
void SetMinLogLevel(int v);
}
} // namespace sentencepiece

struct moe_spm {
    sentencepiece::SentencePieceProcessor sp;
    // The same model without the dummy prefix (normalizer_spec.add_dummy_prefix
    // off), for text that continues a document: "▁" starts the document only.
    sentencepiece::SentencePieceProcessor sp_cont;
    bool have_cont = false;
};

namespace {

void quiet() {
    sentencepiece::logging::SetMinLogLevel(3); // FATAL only: the errors come back as Status
}

// One line of a Status: libsentencepiece's parse failure names its own source
// line and the protobuf call, which means nothing to a user.
std::string explain(const sentencepiece::util::Status &st) {
    std::string m = st.ToString();
    if (m.find("ParseFromArray") != std::string::npos)
        return "not a SentencePiece model (protobuf parse failed; truncated or another format?)";
    return "not a usable SentencePiece model (" + m + ")";
}

// Protobuf wire format, as much as the patch below needs.
bool get_varint(const std::string &b, size_t &i, uint64_t &v) {
    v = 0;
    for (int sh = 0; sh < 64; sh += 7) {
        if (i >= b.size()) return false;
        uint8_t c = static_cast<uint8_t>(b[i++]);
        v |= static_cast<uint64_t>(c & 0x7f) << sh;
        if (!(c & 0x80)) return true;
    }
    return false;
}

void put_varint(std::string &o, uint64_t v) {
    for (; v >= 0x80; v >>= 7)
        o.push_back(static_cast<char>(v | 0x80));
    o.push_back(static_cast<char>(v));
}

// Field at b[i] -> its number, and i past it; false when malformed.
bool next_field(const std::string &b, size_t &i, uint64_t &field, std::string *payload) {
    uint64_t tag, v;
    if (!get_varint(b, i, tag)) return false;
    field = tag >> 3;
    switch (tag & 7) {
    case 0:
        return get_varint(b, i, v);
    case 1:
        return (i += 8) <= b.size();
    case 5:
        return (i += 4) <= b.size();
    case 2:
        if (!get_varint(b, i, v) || v > b.size() - i) return false;
        if (payload) *payload = b.substr(i, v);
        i += v;
        return true;
    }
    return false;
}

// The serialized ModelProto with normalizer_spec (field 3).add_dummy_prefix
// (field 3, bool) set to false; every other byte kept. Empty when malformed.
std::string without_dummy_prefix(const std::string &m) {
    std::string out, spec;
    for (size_t i = 0; i < m.size();) {
        size_t start = i;
        uint64_t field;
        std::string payload;
        if (!next_field(m, i, field, &payload)) return "";
        if (field != 3 || (m[start] & 7) != 2) {
            out.append(m, start, i - start);
            continue;
        }
        for (size_t k = 0; k < payload.size();) { // drop add_dummy_prefix, keep the rest
            size_t s = k;
            uint64_t f;
            if (!next_field(payload, k, f, nullptr)) return "";
            if (f != 3) spec.append(payload, s, k - s);
        }
    }
    // (an absent normalizer_spec means its defaults: written here, but for this)
    spec += std::string("\x18\x00", 2);
    out.push_back(0x1a);
    put_varint(out, spec.size());
    return out + spec;
}

} // namespace

extern "C" int moe_spm_load(const void *bytes, size_t len, const char *name, moe_spm **out) {
    *out = nullptr;
    try {
        quiet();
        moe_spm *s = new moe_spm;
        auto st = s->sp.LoadFromSerializedProto(
            std::string(static_cast<const char *>(bytes), len)); // absl or std string_view
        if (!st.ok()) {
            std::string why = explain(st);
            delete s;
            return moe_fail(MOE_EFORMAT, "%s: %s", name, why.c_str());
        }
        if (s->sp.GetPieceSize() < 1) {
            delete s;
            return moe_fail(MOE_EFORMAT, "%s: SentencePiece model with no pieces", name);
        }
        std::string cont = without_dummy_prefix(std::string(static_cast<const char *>(bytes), len));
        s->have_cont = !cont.empty() && s->sp_cont.LoadFromSerializedProto(cont).ok() &&
                       s->sp_cont.GetPieceSize() == s->sp.GetPieceSize();
        *out = s;
        return 0;
    } catch (const std::bad_alloc &) {
        return moe_fail(MOE_ENOMEM, "%s: out of memory", name);
    } catch (const std::exception &e) {
        return moe_fail(MOE_EFORMAT, "%s: SentencePiece: %s", name, e.what());
    } catch (...) {
        return moe_fail(MOE_EFORMAT, "%s: SentencePiece failed to load it", name);
    }
}

extern "C" void moe_spm_free(moe_spm *s) {
    delete s;
}

extern "C" int moe_spm_vocab_size(const moe_spm *s) {
    return s->sp.GetPieceSize();
}

extern "C" int moe_spm_bos_id(const moe_spm *s) {
    return s->sp.bos_id();
}

extern "C" int moe_spm_eos_id(const moe_spm *s) {
    return s->sp.eos_id();
}

extern "C" int moe_spm_unk_id(const moe_spm *s) {
    return s->sp.unk_id();
}

extern "C" int moe_spm_encode(const moe_spm *s, const char *text, size_t len, int32_t **ids,
                              size_t *n) {
    return moe_spm_encode_part(s, text, len, 1, ids, n);
}

extern "C" int moe_spm_encode_part(const moe_spm *s, const char *text, size_t len, int first,
                                   int32_t **ids, size_t *n) {
    *ids = nullptr;
    *n = 0;
    if (!first && !s->have_cont)
        return moe_fail(MOE_EINVAL, "tokenizer: this SentencePiece model cannot encode text "
                                    "that continues a document (its normalizer spec)");
    try {
        std::vector<int> v;
        auto st = (first ? s->sp : s->sp_cont).Encode(std::string(text, len), &v);
        if (!st.ok())
            return moe_fail(MOE_EINVAL, "tokenizer: cannot encode: %s", st.ToString().c_str());
        int32_t *o = static_cast<int32_t *>(malloc(sizeof(int32_t) * (v.size() ? v.size() : 1)));
        if (!o) return moe_fail(MOE_ENOMEM, "tokenizer: %zu tokens: out of memory", v.size());
        for (size_t i = 0; i < v.size(); i++)
            o[i] = v[i];
        *ids = o;
        *n = v.size();
        return 0;
    } catch (const std::bad_alloc &) {
        return moe_fail(MOE_ENOMEM, "tokenizer: encoding %zu bytes: out of memory", len);
    } catch (...) {
        return moe_fail(MOE_EINVAL, "tokenizer: encoding %zu bytes failed", len);
    }
}

extern "C" int moe_spm_decode(const moe_spm *s, const int32_t *ids, size_t n, char **text,
                              size_t *len) {
    *text = nullptr;
    *len = 0;
    try {
        std::vector<int> v(ids, ids + n);
        std::string out;
        auto st = s->sp.Decode(v, &out);
        if (!st.ok())
            return moe_fail(MOE_EINVAL, "tokenizer: cannot decode: %s", st.ToString().c_str());
        char *o = static_cast<char *>(malloc(out.size() + 1));
        if (!o) return moe_fail(MOE_ENOMEM, "tokenizer: decoding: out of memory");
        memcpy(o, out.data(), out.size());
        o[out.size()] = 0;
        *text = o;
        *len = out.size();
        return 0;
    } catch (const std::bad_alloc &) {
        return moe_fail(MOE_ENOMEM, "tokenizer: decoding %zu tokens: out of memory", n);
    } catch (...) {
        return moe_fail(MOE_EINVAL, "tokenizer: decoding %zu tokens failed", n);
    }
}

extern "C" int moe_spm_piece(const moe_spm *s, int32_t id, char *buf, size_t cap) {
    try {
        const std::string &p = s->sp.IdToPiece(id);
        snprintf(buf, cap, "%s", p.c_str());
        return p.size() > INT_MAX ? INT_MAX : static_cast<int>(p.size());
    } catch (...) {
        return moe_fail(MOE_EINVAL, "tokenizer: no piece for id %d", id);
    }
}

extern "C" float moe_spm_score(const moe_spm *s, int32_t id) {
    try {
        return s->sp.GetScore(id);
    } catch (...) {
        return 0.0f;
    }
}

extern "C" int moe_spm_is_special(const moe_spm *s, int32_t id) {
    try {
        return s->sp.IsControl(id) || s->sp.IsUnknown(id);
    } catch (...) {
        return 0;
    }
}

extern "C" int moe_spm_train(const char *input, const char *model_prefix, int vocab_size) {
    try {
        quiet();
        std::unordered_map<std::string, std::string> args = {
            {"input", input},
            {"model_prefix", model_prefix},
            {"vocab_size", std::to_string(vocab_size)},
            {"model_type", "bpe"},
            {"byte_fallback", "true"},
            {"character_coverage", "1.0"},
            // Llama's normalizer: text as given (transformers' LlamaTokenizerFast
            // reproduces it; NFKC and whitespace folding it does not)
            {"normalization_rule_name", "identity"},
            {"remove_extra_whitespaces", "false"},
        };
        auto st = sentencepiece::SentencePieceTrainer::Train(args);
        if (!st.ok())
            return moe_fail(MOE_EINVAL, "%s: training a SentencePiece model failed: %s", input,
                            st.ToString().c_str());
        return 0;
    } catch (const std::bad_alloc &) {
        return moe_fail(MOE_ENOMEM, "%s: training a SentencePiece model: out of memory", input);
    } catch (...) {
        return moe_fail(MOE_EINVAL, "%s: training a SentencePiece model failed", input);
    }
}
