//! SentencePiece-style (`tokenizer.ggml.model = llama`) tokenization on a small hand-made
//! vocabulary: score-ordered merges, the space prefix, byte fallback and BOS.

use gguf::{Value, ValueType, Writer};
use text::{Tokenizer, TokenizerModel};

fn spm_tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    // Pieces with scores: a higher score merges first.
    for (piece, score) in [
        ("\u{2581}", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("w", -2.0),
        ("r", -2.0),
        ("d", -2.0),
        ("ll", -3.0),
        ("he", -4.0),
        ("hell", -5.0),
        ("hello", -6.0),
        ("\u{2581}hello", -7.0),
        ("or", -3.5),
        ("\u{2581}w", -4.5),
        ("\u{2581}wor", -8.0),
    ] {
        tokens.push(piece.into());
        types.push(1);
        scores.push(score);
    }
    let mut w = Writer::new(3);
    w.metadata("tokenizer.ggml.model", Value::String("llama".into()))
        .metadata("tokenizer.ggml.tokens", Value::strings(&tokens))
        .metadata(
            "tokenizer.ggml.scores",
            Value::Array(ValueType::F32, scores.into_iter().map(Value::F32).collect()),
        )
        .metadata(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        )
        .metadata("tokenizer.ggml.bos_token_id", Value::U32(1))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(2));
    let f = gguf::GgufFile::from_bytes(w.to_bytes()).unwrap();
    Tokenizer::from_header(f.header()).unwrap()
}

fn pieces(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| t.token_text(i).unwrap().to_string())
        .collect()
}

#[test]
fn words_merge_by_score_with_the_space_prefix_and_bos() {
    let t = spm_tokenizer();
    assert_eq!(t.model(), TokenizerModel::Spm);
    let ids = t.encode("hello world", true, false);
    assert_eq!(ids[0], 1, "BOS is added by default for SPM vocabularies");
    assert_eq!(
        pieces(&t, &ids[1..]),
        ["\u{2581}hello", "\u{2581}wor", "l", "d"]
    );
    assert_eq!(t.decode(&ids, false).unwrap(), " hello world");
}

#[test]
fn unknown_characters_fall_back_to_byte_tokens() {
    let t = spm_tokenizer();
    let ids = t.encode("hé", false, false);
    assert_eq!(pieces(&t, &ids), ["\u{2581}", "h", "<0xC3>", "<0xA9>"]);
    assert_eq!(t.decode(&ids, false).unwrap(), " hé");
}

#[test]
fn control_tokens_are_parsed_only_when_asked() {
    let t = spm_tokenizer();
    let parsed = t.encode("hello</s>", false, true);
    assert_eq!(*parsed.last().unwrap(), 2);
    let literal = t.encode("hello</s>", false, false);
    assert!(!literal.contains(&2));
}
