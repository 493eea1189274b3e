use std::time::Instant;
fn main() {
    let body = std::fs::read(std::env::args().nth(1).unwrap()).unwrap();
    let n = 2000;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..n {
            let v: warmpath_wire::openai::ChatCompletionRequest = serde_json::from_slice(&body).unwrap();
            std::hint::black_box(v);
        }
        let typed = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        let t = Instant::now();
        for _ in 0..n {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            std::hint::black_box(v);
        }
        let value = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        let t = Instant::now();
        for _ in 0..n {
            let v: serde::de::IgnoredAny = serde_json::from_slice(&body).unwrap();
            std::hint::black_box(v);
        }
        let ign = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!("typed {typed:.1} us, value {value:.1} us, ignored {ign:.1} us");
    }
}
