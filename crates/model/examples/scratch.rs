fn main() {
    let f = gguf::GgufFile::open(std::env::args().nth(1).unwrap()).unwrap();
    let m = model::Model::load(&f, None, model::ModelOptions::default()).unwrap();
    println!(
        "{:?} isa {:?} bytes {}",
        m.config(),
        m.isa(),
        m.weight_bytes()
    );
    let ids: Vec<u32> = vec![504, 3575, 282, 4649, 314];
    let mut cache = m.new_cache(1024);
    let rows: Vec<model::Row> = ids
        .iter()
        .enumerate()
        .map(|(i, &t)| model::Row {
            seq: 0,
            pos: i,
            token: t,
            want_logits: i == ids.len() - 1,
        })
        .collect();
    let t = std::time::Instant::now();
    let model::Output::Logits(l) = m
        .forward(
            model::Batch {
                rows: &rows,
                hidden: None,
            },
            &mut [&mut cache],
        )
        .unwrap()
    else {
        panic!()
    };
    println!("{:?} {:?}", model::sampling::top_k(&l, 5), t.elapsed());
    let mut tok = model::sampling::top_k(&l, 1)[0].0;
    let mut out = vec![tok];
    let t = std::time::Instant::now();
    for i in 0..31 {
        let rows = [model::Row {
            seq: 0,
            pos: ids.len() + i,
            token: tok,
            want_logits: true,
        }];
        let model::Output::Logits(l) = m
            .forward(
                model::Batch {
                    rows: &rows,
                    hidden: None,
                },
                &mut [&mut cache],
            )
            .unwrap()
        else {
            panic!()
        };
        tok = model::sampling::top_k(&l, 1)[0].0;
        out.push(tok);
    }
    println!("{:?} {:?}/tok", out, t.elapsed() / 31);
}
