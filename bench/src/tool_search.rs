//! `tool-search`: how well warmpath's `tool_search` finds the tool a turn needs. A labelled set
//! (bench/data/tool-search.json: 40 tools of a typical agent, 50 requests phrased the way a
//! model asks, each with the tools that serve it) is searched with warmpath's BM25 index and,
//! side by side, with plain word overlap (no weighting), the baseline BM25 must beat.

use std::fmt::Write as _;
use std::sync::Arc;

use serde::Deserialize;
use warmpath::tools::bm25::{words, Bm25};
use warmpath::tools::def::CanonTool;

const DATA: &str = include_str!("../data/tool-search.json");

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Write the report here (default bench/results/tool-search-DATE.md).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Print only; write no file.
    #[arg(long)]
    quick: bool,
}

#[derive(Deserialize)]
struct Labelled {
    tools: Vec<serde_json::Value>,
    queries: Vec<Query>,
}

#[derive(Deserialize)]
struct Query {
    query: String,
    relevant: Vec<String>,
}

/// Word overlap: documents ranked by how many distinct query words they contain.
fn overlap(tools: &[Arc<CanonTool>], query: &str, k: usize) -> Vec<usize> {
    let q: std::collections::HashSet<String> = words(query).into_iter().collect();
    let mut scored: Vec<(usize, usize)> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut doc: Vec<String> = words(&t.name);
            doc.extend(words(&t.description));
            t.params.iter().for_each(|p| doc.extend(words(p)));
            let doc: std::collections::HashSet<String> = doc.into_iter().collect();
            (i, q.intersection(&doc).count())
        })
        .filter(|&(_, n)| n > 0)
        .collect();
    scored.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    scored.into_iter().take(k).map(|(i, _)| i).collect()
}

/// Mean recall@k and MRR over the queries.
fn score(
    set: &Labelled,
    tools: &[Arc<CanonTool>],
    search: &dyn Fn(&str, usize) -> Vec<usize>,
) -> (Vec<f64>, f64) {
    let ks = [1, 3, 5];
    let mut recall = vec![0.0; ks.len()];
    let mut mrr = 0.0;
    for q in &set.queries {
        let ranked: Vec<&str> = search(&q.query, 10).into_iter().map(|i| tools[i].name.as_str()).collect();
        for (j, &k) in ks.iter().enumerate() {
            let hit = q.relevant.iter().filter(|r| ranked.iter().take(k).any(|n| n == r)).count();
            recall[j] += hit as f64 / q.relevant.len() as f64;
        }
        if let Some(pos) = ranked.iter().position(|n| q.relevant.iter().any(|r| r == n)) {
            mrr += 1.0 / (pos + 1) as f64;
        }
    }
    let n = set.queries.len() as f64;
    (recall.into_iter().map(|r| r / n).collect(), mrr / n)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let set: Labelled = serde_json::from_str(DATA)?;
    let tools: Vec<Arc<CanonTool>> = set
        .tools
        .iter()
        .map(|t| CanonTool::parse(&t.to_string()).map(Arc::new).map_err(anyhow::Error::msg))
        .collect::<Result<_, _>>()?;
    let index = Bm25::new(&tools);
    let bm25 = score(&set, &tools, &|q, k| index.search(q, k));
    let base = score(&set, &tools, &|q, k| overlap(&tools, q, k));
    let cmd: Vec<String> = std::env::args().collect();
    let mut md = String::new();
    let _ = writeln!(md, "# tool_search recall — {}\n", crate::report::date());
    let _ = writeln!(md, "Command: `{}`\n", cmd.join(" "));
    let _ = writeln!(
        md,
        "{} tools, {} labelled requests (bench/data/tool-search.json); recall@k: the share of a request's \
         relevant tools among the first k results, averaged; MRR: mean reciprocal rank of the first relevant one.\n",
        tools.len(),
        set.queries.len()
    );
    let _ = writeln!(md, "| search | recall@1 | recall@3 | recall@5 | MRR |");
    let _ = writeln!(md, "| --- | ---: | ---: | ---: | ---: |");
    for (name, (r, mrr)) in [("warmpath BM25", &bm25), ("word overlap (baseline)", &base)] {
        let _ = writeln!(md, "| {name} | {:.3} | {:.3} | {:.3} | {mrr:.3} |", r[0], r[1], r[2]);
    }
    let _ =
        writeln!(md, "\n- BM25 recall@5 / baseline recall@5: **{:.2}×**", bm25.0[2] / base.0[2].max(1e-9));
    let misses: Vec<&str> = set
        .queries
        .iter()
        .filter(|q| {
            let top: Vec<&str> =
                index.search(&q.query, 5).into_iter().map(|i| tools[i].name.as_str()).collect();
            !q.relevant.iter().any(|r| top.contains(&r.as_str()))
        })
        .map(|q| q.query.as_str())
        .collect();
    let _ = writeln!(
        md,
        "- requests with no relevant tool in BM25's top 5: {}",
        if misses.is_empty() { "none".to_owned() } else { misses.join("; ") }
    );
    crate::report::publish(&md, "tool-search", a.out, a.quick)
}
