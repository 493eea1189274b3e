//! Prefill/decode disaggregation through warmpath: a pool whose backends have roles sends each
//! request's prefill to a prefill engine and its decode, with the prefill's
//! `kv_transfer_params`, to a decode engine, which fetches the K/V. Real engine processes on
//! 127.0.0.1.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};
use warmpath_tests::*;

/// A pool of `backends` (name, url, role) under `policy`, every prompt prefilled remotely.
fn pool(policy: &str, backends: &[(&str, String, &str)]) -> String {
    split_pool(policy, 0, backends)
}

/// [`pool`] prefilling remotely only prompts of `min` tokens or more.
fn split_pool(policy: &str, min: usize, backends: &[(&str, String, &str)]) -> String {
    let mut s = format!(
        "[[pools]]\nname = \"main\"\nmodels = [\"m\"]\npolicy = {policy:?}\n[pools.disagg]\nmin_prompt_tokens = {min}\n"
    );
    for (name, url, role) in backends {
        s.push_str(&format!("\n[[pools.backends]]\nname = {name:?}\nurl = {url:?}\nrole = {role:?}\n"));
    }
    s
}

fn ask(words: usize, max_tokens: u32, stream: bool) -> Value {
    let text: String = (0..words).map(|i| format!("word{} ", i % 89)).collect();
    json!({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true, "stream": stream})
}

fn micro(extra: &[&str]) -> Engine {
    let mut args: Vec<String> =
        ["--model", "micro", "--served-model-name", "m", "--kv-blocks", "256", "--threads", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    Engine::start_args(args, 0)
}

#[test]
fn a_request_is_prefilled_on_one_engine_and_decoded_on_another_with_the_same_answer() {
    // The real forward pass (micro's dummy weights), greedy: the answer through the split pool
    // is the one an engine computing everything gives.
    let p = micro(&["--kv-transfer-port", "0"]);
    let d = micro(&[]);
    let alone = micro(&[]);
    let proxy = Proxy::start(&pool("cache_aware", &[("p", p.url(), "prefill"), ("d", d.url(), "decode")]));
    let r = post_json(proxy.addr, "/v1/chat/completions", &ask(80, 10, false));
    assert_eq!(r.status, 200, "{}", r.text());
    let route = r.header("x-warmpath-route").expect("route header").to_owned();
    assert!(route.contains("prefill=p"), "{route}");
    assert_eq!(r.header("x-warmpath-backend"), Some("d"));
    let direct = post_json(alone.addr, "/v1/chat/completions", &ask(80, 10, false));
    assert_eq!(r.json()["choices"][0]["message"], direct.json()["choices"][0]["message"]);
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
    assert!(cached >= 64, "the decode engine loaded the prompt: {}", r.text());

    let dm = d.metrics();
    let received = series(&dm, "warmpath_engine_kv_transfer_blocks_total", "\"received\"");
    assert_eq!(received * 16.0, cached as f64);
    assert_eq!(series(&p.metrics(), "warmpath_engine_kv_transfer_blocks_total", "\"sent\""), received);
    assert_eq!(series(&p.metrics(), "warmpath_engine_kv_held_blocks", ""), 0.0, "fetched, so freed");
    let pm = proxy.metrics();
    assert_eq!(series(&pm, "warmpath_prefills_total", "outcome=\"ok\""), 1.0);
    assert_eq!(series(&pm, "warmpath_prefill_duration_seconds_count", ""), 1.0);

    // Streamed the same way, ending as any stream does.
    let r = post_json(proxy.addr, "/v1/chat/completions", &ask(80, 10, true));
    assert_eq!(r.status, 200);
    let (data, _) = sse(&r.text());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(series(&proxy.metrics(), "warmpath_prefills_total", "outcome=\"ok\""), 2.0);
}

#[test]
fn a_failed_prefill_is_retried_on_another_prefill_engine_and_then_given_up() {
    let gone = format!("http://127.0.0.1:{}", free_port());
    let p = Engine::sim("m", &["--kv-transfer-port", "0"]);
    let d = Engine::sim("m", &[]);
    let both = pool(
        "round_robin",
        &[("dead", gone.clone(), "prefill"), ("p", p.url(), "prefill"), ("d", d.url(), "decode")],
    );
    let proxy = Proxy::start_with(&format!("[health]\nenabled = false\n{both}"), false);
    for _ in 0..2 {
        let r = post_json(proxy.addr, "/v1/chat/completions", &ask(60, 4, false));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.header("x-warmpath-route").is_some_and(|h| h.contains("prefill=p")));
    }
    let pm = proxy.metrics();
    assert_eq!(series(&pm, "warmpath_prefills_total", "outcome=\"ok\""), 2.0);
    assert!(series(&pm, "warmpath_retries_total", "pool=\"main:prefill\"") >= 1.0, "{pm}");

    // With no prefill engine left, the decode engine computes the prompt itself.
    let alone = pool("round_robin", &[("dead", gone, "prefill"), ("d", d.url(), "decode")]);
    let proxy = Proxy::start_with(&format!("[health]\nenabled = false\n{alone}"), false);
    let r = post_json(proxy.addr, "/v1/chat/completions", &ask(60, 4, true));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("x-warmpath-route").is_some_and(|h| !h.contains("prefill=")));
    assert_eq!(sse(&r.text()).0.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(series(&proxy.metrics(), "warmpath_prefills_total", "outcome=\"failed\""), 1.0);
}

#[test]
fn a_client_leaving_during_the_prefill_frees_its_blocks_and_nothing_is_decoded() {
    // A prefill of about 2 s (sim), one engine step: the client leaves after 300 ms. The step
    // runs to its end (an abort takes effect between steps, as in vLLM), and what it computed is
    // not held for a decode that will not come.
    let p = Engine::sim("m", &["--kv-transfer-port", "0", "--sim-prefill-us-per-token", "5000"]);
    let d = Engine::sim("m", &[]);
    let proxy = Proxy::start(&pool("round_robin", &[("p", p.url(), "prefill"), ("d", d.url(), "decode")]));
    let body = ask(200, 4, true).to_string();
    let mut s = TcpStream::connect(proxy.addr).expect("connect");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let queued =
        |m: &str| series(m, "vllm:num_requests_running", "") + series(m, "vllm:num_requests_waiting", "");
    assert!(eventually(Duration::from_secs(5), || queued(&p.metrics()) == 1.0), "the prefill engine has it");
    std::thread::sleep(Duration::from_millis(300));
    drop(s);
    assert!(
        eventually(Duration::from_secs(5), || queued(&p.metrics()) == 0.0),
        "the prefill engine let it go"
    );
    assert!(
        eventually(Duration::from_secs(2), || series(&p.metrics(), "warmpath_engine_kv_held_blocks", "")
            == 0.0),
        "abandoned, not held"
    );
    assert_eq!(series(&d.metrics(), "vllm:prompt_tokens_total", ""), 0.0, "no decode was sent");
}

#[test]
fn a_decode_engine_dying_after_its_first_tokens_ends_the_stream_with_an_error_event() {
    let p = Engine::sim("m", &["--kv-transfer-port", "0"]);
    let d = Engine::sim("m", &["--fault-die-after-tokens", "2"]);
    let proxy = Proxy::start(&pool("round_robin", &[("p", p.url(), "prefill"), ("d", d.url(), "decode")]));
    let r = post_json(proxy.addr, "/v1/chat/completions", &ask(60, 8, true));
    assert_eq!(r.status, 200);
    let (data, _) = sse(&r.text());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap_or_else(|_| panic!("{data:?}"));
    assert!(last["error"]["message"].as_str().is_some_and(|m| m.contains("broke")), "{data:?}");
    assert_eq!(series(&proxy.metrics(), "warmpath_prefills_total", "outcome=\"ok\""), 1.0);
}

#[test]
fn an_embedded_pool_splits_its_replicas_into_prefill_and_decode() {
    let proxy = Proxy::start(
        "[[pools]]\nname = \"e\"\nmodels = [\"m\"]\n[pools.disagg]\nmin_prompt_tokens = 0\n\
         [pools.embedded]\nreplicas = 3\nprefill_replicas = 1\n\
         model = \"micro\"\nexecutor = \"sim\"\n",
    );
    for _ in 0..2 {
        let r = post_json(proxy.addr, "/v1/chat/completions", &ask(60, 3, true));
        assert_eq!(r.status, 200, "{}", r.text());
        let route = r.header("x-warmpath-route").expect("route").to_owned();
        assert!(route.contains("prefill=e-0"), "{route}");
        assert!(r.header("x-warmpath-backend").is_some_and(|b| b == "e-1" || b == "e-2"));
    }
    assert_eq!(series(&proxy.metrics(), "warmpath_prefills_total", "outcome=\"ok\""), 2.0);
}

#[test]
fn short_prompts_are_prefilled_where_they_are_decoded() {
    let p = Engine::sim("m", &["--kv-transfer-port", "0"]);
    let d = Engine::sim("m", &[]);
    let proxy =
        Proxy::start(&split_pool("cache_aware", 200, &[("p", p.url(), "prefill"), ("d", d.url(), "decode")]));
    let short = post_json(proxy.addr, "/v1/chat/completions", &ask(20, 2, false));
    assert_eq!(short.status, 200);
    assert!(short.header("x-warmpath-route").is_some_and(|h| !h.contains("prefill=")), "under 200 tokens");
    let long = post_json(proxy.addr, "/v1/chat/completions", &ask(300, 2, false));
    assert!(long.header("x-warmpath-route").is_some_and(|h| h.contains("prefill=p")), "over 200 tokens");
    assert_eq!(series(&proxy.metrics(), "warmpath_prefills_total", ""), 1.0);
}

#[test]
fn a_busy_holders_prefix_is_fetched_by_another_engine() {
    // Two engines that serve their K/V to each other; a conversation's holder is busy with a
    // long prefill, so its next turn goes to the other engine, which fetches the prefix (a
    // fetched token weighed as a queued one here, to keep the busy turn short).
    let ports: [u16; 2] = free_ports();
    let slow = ["--sim-prefill-us-per-token", "1000"];
    let es: Vec<Engine> = ports
        .iter()
        .map(|p| Engine::sim("m", &[&["--kv-transfer-port", &p.to_string()], &slow[..]].concat()))
        .collect();
    let mut text = String::from(
        "[[pools]]\nname = \"main\"\nmodels = [\"m\"]\npolicy = \"cache_aware\"\n[pools.canon]\ntokenizer = \"wp32k\"\n\
         [pools.cache_aware]\nfetch_weight = 1.0\n",
    );
    for (i, (e, p)) in es.iter().zip(ports).enumerate() {
        text.push_str(&format!(
            "[[pools.backends]]\nname = \"e{i}\"\nurl = {:?}\nkv_transfer = \"127.0.0.1:{p}\"\n",
            e.url()
        ));
    }
    let proxy = Proxy::start(&text);
    let system = format!("You are the build agent. {}", "Keep every rule of the handbook. ".repeat(40));
    let turn = |user: &str| {
        json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]})
    };
    let first = post_json(proxy.addr, "/v1/chat/completions", &turn("hi"));
    assert_eq!(first.status, 200, "{}", first.text());
    let home = first.header("x-warmpath-backend").expect("backend").to_owned();
    // A long new tail behind the same prefix keeps the holder prefilling for about 1.5 s.
    let long: String = (0..700).map(|i| format!("item{i} ")).collect();
    let addr = proxy.addr;
    let long_turn = turn(&long);
    let busy = std::thread::spawn(move || post_json(addr, "/v1/chat/completions", &long_turn));
    std::thread::sleep(Duration::from_millis(300));
    let next = post_json(proxy.addr, "/v1/chat/completions", &turn("and now?"));
    assert_eq!(next.status, 200, "{}", next.text());
    let route = next.header("x-warmpath-route").expect("route").to_owned();
    assert!(route.contains("reason=fetch") && route.contains(&format!("fetch_from={home}")), "{route}");
    assert_ne!(next.header("x-warmpath-backend"), Some(home.as_str()));
    let cached = next.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= 256, "the prefix came from the holder: {}", next.text());
    let other =
        es.iter().find(|e| e.url() != es[home[1..].parse::<usize>().expect("index")].url()).expect("other");
    assert!(series(&other.metrics(), "warmpath_engine_kv_transfer_blocks_total", "\"received\"") >= 16.0);
    assert_eq!(busy.join().expect("the long turn").status, 200);
}

#[test]
fn a_clients_own_kv_transfer_params_are_removed_unless_the_pool_allows_them() {
    // A listener standing for "wherever the client says": the engine must not be sent there.
    let trap = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    trap.set_nonblocking(true).expect("nonblocking");
    let e = Engine::sim("m", &[]);
    let mut body = ask(60, 2, false);
    body["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_host": "127.0.0.1",
        "remote_port": trap.local_addr().expect("addr").port(), "remote_request_id": "1"});
    for (allowed, reached) in [(false, false), (true, true)] {
        let text = format!(
            "[[pools]]\nname = \"main\"\nmodels = [\"m\"]\n[pools.disagg]\nclient_params = {allowed}\n\
             [[pools.backends]]\nname = \"e\"\nurl = {:?}\n",
            e.url()
        );
        let proxy = Proxy::start(&text);
        let r = post_json(proxy.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let connected = eventually(Duration::from_millis(500), || trap.accept().is_ok());
        assert_eq!(connected, reached, "client_params = {allowed}");
    }
}
