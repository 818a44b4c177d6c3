//! Tokenizing costs time in proportion to the text, whatever the text is: one long word, a run
//! of punctuation or of spaces, thousands of special tokens. Each case is timed at two sizes in
//! the same run and the ratio compared with the ratio of the sizes (quadratic work would make
//! it that ratio squared). A prompt that cannot fit a context is refused without tokenizing it.

use std::time::{Duration, Instant};

use text::Tokenizer;

fn tokenizer() -> Tokenizer {
    let f = gguf::GgufFile::open(testkit::real_model()).unwrap();
    Tokenizer::from_header(f.header()).unwrap()
}

/// The fastest of three runs (the least disturbed by whatever else the machine does).
fn time(f: impl Fn()) -> Duration {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap()
}

#[test]
fn tokenizing_takes_time_in_proportion_to_the_text() {
    let tok = tokenizer();
    let (small, factor) = (2_000, 16);
    type Make = fn(usize) -> String;
    let cases: [(&str, Make); 5] = [
        ("one long word", |n| "a".repeat(n)),
        ("punctuation", |n| ".".repeat(n)),
        ("spaces", |n| " ".repeat(n)),
        ("special tokens", |n| "<|im_start|>".repeat(n / 12)),
        ("prose", |n| {
            "The quick brown fox, 12 times; don't stop!\n"
                .repeat(n / 43 + 1)
                .chars()
                .take(n)
                .collect()
        }),
    ];
    let mut report = Vec::new();
    for (name, make) in cases {
        let (a, b) = (make(small), make(small * factor));
        let ta = time(|| drop(tok.encode(&a, true, true)));
        let tb = time(|| drop(tok.encode(&b, true, true)));
        // Linear is `factor`; allow for n log n, caches and timer noise, never for the square.
        let ratio = tb.as_secs_f64() / ta.as_secs_f64().max(1e-6);
        report.push(format!("{name}: {ta:?} -> {tb:?} (x{ratio:.1})"));
        assert!(
            ratio < (factor * 4) as f64 || tb < Duration::from_millis(5),
            "{name}: {factor}x the text took {ratio:.1}x the time\n{}",
            report.join("\n")
        );
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn a_text_that_cannot_fit_the_limit_is_refused_without_tokenizing_it() {
    let tok = tokenizer();
    for text in [
        "a".repeat(1 << 20),
        ".".repeat(1 << 20),
        " ".repeat(1 << 20),
    ] {
        let t = Instant::now();
        let e = tok.encode_within(&text, true, true, 4096).unwrap_err();
        assert!(e.at_least > 4096, "{e:?}");
        // Refused on its length alone: far less time than tokenizing a megabyte.
        let quick = t.elapsed();
        let t = Instant::now();
        let n = tok.encode(&text, true, true).len();
        let full = t.elapsed();
        assert!(n > 4096);
        assert!(quick * 20 < full, "{quick:?} vs {full:?}");
    }
    // A text that fits is tokenized as by `encode`; one that does not says how far it got.
    let text = "The capital of France is Paris. ".repeat(40);
    assert_eq!(
        tok.encode_within(&text, true, true, 4096).unwrap(),
        tok.encode(&text, true, true)
    );
    let e = tok.encode_within(&text, true, true, 20).unwrap_err();
    assert!(e.at_least > 20, "{e:?}");
}
