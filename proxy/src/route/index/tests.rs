use super::*;

fn chain(root: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| xxhash_rust::xxh3::xxh3_64(&[root, i].map(u64::to_le_bytes).concat())).collect()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        crate::route::draw::xorshift(&mut self.0)
    }
}

#[test]
fn depths_are_each_backends_matched_prefix() {
    let idx = PrefixIndex::new(4, 1000, None);
    let c = chain(1, 100);
    idx.insert(0, &c[..100]);
    idx.insert(1, &c[..37]);
    idx.insert(2, &c[..1]);
    assert_eq!(idx.depths(&c), vec![100, 37, 1, 0]);
    // A request that extends the chain: backend 0 holds its first 100 blocks.
    let mut longer = c.clone();
    longer.extend(chain(2, 50));
    assert_eq!(idx.depths(&longer), vec![100, 37, 1, 0]);
    assert_eq!(idx.depths(&chain(3, 10)), vec![0; 4]);
    assert_eq!(idx.depths(&[]), vec![0; 4]);
    assert_eq!(idx.depths(&c[..1]), vec![1, 1, 1, 0]);
}

#[test]
fn depths_match_a_linear_walk_on_random_chains_past_one_mask() {
    // More backends than one mask covers, at many depths of one chain, against the obvious walk.
    let n = 300;
    let idx = PrefixIndex::new(n, 10_000, None);
    let c = chain(9, 500);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut want = vec![0u32; n];
    for (b, w) in want.iter_mut().enumerate() {
        let d = if b % 5 == 0 { 0 } else { (rng.next() % 501) as usize };
        idx.insert(b, &c[..d]);
        *w = d as u32;
    }
    // The first blocks have more holders than are tracked: held everywhere.
    let (tracked, everywhere) = idx.holders(c[0]);
    assert!(everywhere && tracked.len() == TRACKED_HOLDERS);
    let everywhere_to = (0..c.len()).take_while(|&i| idx.holders(c[i]).1).count() as u32;
    let want: Vec<u32> = want.iter().map(|&d| d.max(everywhere_to)).collect();
    assert_eq!(idx.depths(&c), want);
}

#[test]
fn a_sample_measures_the_deepest_holders_and_the_named_backends_exactly() {
    let n = 1000;
    let idx = PrefixIndex::new(n, 10_000, None);
    let system = chain(1, 10);
    let mut rng = Rng(7);
    // A shared system prompt on 40 backends, a conversation on two of them.
    for _ in 0..40 {
        idx.insert((rng.next() % n as u64) as usize, &system);
    }
    let mut conv = system.clone();
    conv.extend(chain(2, 30));
    idx.insert(500, &conv);
    idx.insert(501, &conv[..25]);
    let random = [3usize, 4, 500];
    let got = idx.sampled_depths(&conv, &[7], &random, 128);
    let all = idx.depths(&conv);
    assert_eq!(got[0].0, 7, "pinned first");
    assert_eq!(got[1], (500, 40), "then the deepest holder");
    for &(b, d) in &got {
        assert_eq!(d, all[b], "backend {b} measured exactly");
    }
    let members: Vec<usize> = got.iter().map(|&(b, _)| b).collect();
    assert!(members.contains(&501) && members.contains(&3) && members.contains(&4));
    assert_eq!(members.iter().filter(|&&b| b == 500).count(), 1, "each backend once");
    let holders = idx.holders(system[0]).0.len();
    assert_eq!(got.len(), 1 + 1 + 2 + (holders - 1), "pinned, deepest, random, the others holding the root");
    // A cap on the sample.
    assert_eq!(idx.sampled_depths(&conv, &[], &random, 2).len(), 2);
    assert!(idx.sampled_depths(&chain(5, 3), &[], &[], 128).is_empty());
}

#[test]
fn lru_eviction_takes_leaves_first_and_bounds_memory() {
    let idx = PrefixIndex::new(2, 10, None);
    let a = chain(1, 8);
    let b = chain(2, 8);
    idx.insert(0, &a);
    idx.insert(0, &b);
    // 16 blocks into 10: the oldest chain lost its 6 deepest blocks, not its root.
    assert_eq!(idx.blocks()[0], 10);
    assert_eq!(idx.depths(&a)[0], 2);
    assert_eq!(idx.depths(&b)[0], 8);
    assert_eq!(idx.len(), 10);
    idx.set_capacity(0, 4);
    assert_eq!(idx.depths(&b)[0], 4);
    assert_eq!(idx.depths(&a)[0], 0);
    idx.remove(0, &b[2..]);
    assert_eq!(idx.depths(&b)[0], 2);
    idx.clear(0);
    assert_eq!(idx.len(), 0);
    assert_eq!(idx.blocks(), vec![0, 0]);
}

#[test]
fn shared_blocks_keep_their_other_holders_when_one_lets_go() {
    let idx = PrefixIndex::new(3, 100, None);
    let c = chain(4, 6);
    for b in 0..3 {
        idx.insert(b, &c);
    }
    assert_eq!(idx.len(), 6);
    idx.remove(1, &c[3..]);
    idx.clear(2);
    assert_eq!(idx.depths(&c), vec![6, 3, 0]);
    let (mut holders, everywhere) = idx.holders(c[0]);
    holders.sort();
    assert_eq!((holders, everywhere), (vec![0, 1], false));
    idx.clear(0);
    idx.clear(1);
    assert!(idx.is_empty());
}

#[test]
fn a_resent_conversation_adds_its_turn_behind_its_history() {
    // Within REFRESH the held part is not touched again; new blocks go right behind
    // their parents, so eviction still takes the newest turn's blocks before the history.
    let idx = PrefixIndex::new(1, 12, None);
    let history = chain(1, 8);
    idx.insert(0, &history);
    let mut turn = history.clone();
    turn.extend(chain(2, 3));
    idx.insert(0, &turn);
    assert_eq!(idx.depths(&turn)[0], 11);
    let other = chain(3, 3);
    idx.insert(0, &other); // 14 blocks into 12: two go
    assert_eq!(idx.blocks()[0], 12);
    let d = idx.depths(&turn)[0];
    assert!((8..11).contains(&d), "leaves of the old chain went first, its history stayed: {d}");
    assert_eq!(idx.depths(&other)[0], 3);
    assert_eq!(idx.lock().held_prefix(0, &turn), d as usize);
}

#[test]
fn held_prefix_bisects() {
    let idx = PrefixIndex::new(1, 100, None);
    let c = chain(5, 10);
    let held = |idx: &PrefixIndex| idx.lock().held_prefix(0, &c);
    assert_eq!(held(&idx), 0);
    idx.insert(0, &c[..1]);
    assert_eq!(held(&idx), 1);
    idx.insert(0, &c[..7]);
    assert_eq!(held(&idx), 7);
    idx.insert(0, &c);
    assert_eq!(held(&idx), 10);
    assert_eq!(idx.lock().held_prefix(0, &[]), 0);
}

#[test]
fn a_block_held_past_the_tracked_holders_counts_as_held_everywhere_and_chains_extend_past_it() {
    let n = TRACKED_HOLDERS + 10;
    let idx = PrefixIndex::new(n, 1000, None);
    let system = chain(1, 4);
    for b in 0..n {
        idx.insert(b, &system);
    }
    assert_eq!(idx.blocks()[n - 1], 0, "the late holders are not tracked");
    assert!(idx.depths(&system).iter().all(|&d| d == 4));
    // A late holder's conversation behind the system prompt is tracked in full.
    let mut conv = system.clone();
    conv.extend(chain(2, 5));
    idx.insert(n - 1, &conv);
    assert_eq!(idx.blocks()[n - 1], 5);
    assert_eq!(idx.depths(&conv)[n - 1], 9);
    let mut turn = conv.clone();
    turn.extend(chain(3, 2));
    idx.insert(n - 1, &turn);
    assert_eq!(idx.depths(&turn)[n - 1], 11);
    // When the tracked holders let go, the block stops being held everywhere.
    for b in 0..TRACKED_HOLDERS {
        idx.clear(b);
    }
    assert!(idx.holders(system[0]).0.is_empty() && !idx.holders(system[0]).1);
    assert_eq!(idx.depths(&conv)[n - 1], 0, "the root went with its tracked holders");
}

#[test]
fn entries_older_than_the_ttl_expire() {
    let idx = PrefixIndex::new(1, 100, Some(Duration::from_secs(0)));
    let a = chain(1, 4);
    idx.insert_at(0, &a, 7);
    // Same tick: still there (age 0 is not over a TTL of 0).
    assert_eq!(idx.depths(&a)[0], 4);
    let mut g = idx.lock();
    g.evict(0, Some(0), 9);
    drop(g);
    assert_eq!(idx.depths(&a)[0], 0);
}

#[test]
fn a_backend_idle_past_the_ttl_is_emptied_before_its_ages_could_wrap() {
    let idx = PrefixIndex::new(2, 100, Some(Duration::from_secs(100)));
    let a = chain(1, 4);
    idx.insert_at(0, &a, 0);
    // 2^16 + 50 ticks later its entries' 16-bit ages read 50 ticks, under the TTL; they are gone all
    // the same, and backend 1's fresh copy stays.
    let later = 65_536 + 50;
    idx.insert_at(1, &a, later - 5);
    idx.insert_at(0, &chain(2, 1), later);
    assert_eq!(idx.depths(&a), vec![0, 4]);
    assert_eq!(idx.blocks(), vec![1, 4]);
}

#[test]
fn a_held_block_costs_at_most_32_bytes_at_fleet_scale() {
    let n = 1000;
    let idx = PrefixIndex::new(n, 5_000, None);
    let mut rng = Rng(3);
    for p in 0..2_000u64 {
        let c = chain(p, 200);
        idx.insert((rng.next() % n as u64) as usize, &c);
        if rng.next() % 4 == 0 {
            idx.insert((rng.next() % n as u64) as usize, &c);
        }
    }
    let held: usize = idx.blocks().iter().sum();
    let per = idx.bytes() as f64 / held as f64;
    assert!(per <= 32.0, "{per:.1} B per held block ({held} held, {} bytes)", idx.bytes());
}

#[test]
fn staleness_is_the_age_of_what_a_full_backend_would_evict_next() {
    let idx = PrefixIndex::new(2, 4, None);
    assert_eq!(idx.staleness_of(&[0])[0], u32::MAX, "room: nothing to evict");
    // Ticks just before the index's epoch, on the wrapping 16-bit clock.
    let ago = |ticks: u32| 65_536 - ticks;
    idx.insert_at(0, &chain(1, 4), ago(400));
    idx.insert_at(1, &chain(2, 2), ago(40));
    idx.insert_at(1, &chain(3, 2), ago(8));
    // The index's clock started when it was made: allow for a slow machine since then.
    assert!((400..480).contains(&idx.staleness_of(&[0])[0]), "{}", idx.staleness_of(&[0])[0]);
    assert!((40..120).contains(&idx.staleness_of(&[1])[0]), "{}", idx.staleness_of(&[1])[0]);
    idx.remove(1, &chain(2, 2)[1..]);
    assert_eq!(idx.staleness_of(&[1])[0], u32::MAX);
}

#[test]
fn an_index_out_of_nodes_stops_tracking_instead_of_failing() {
    let idx = PrefixIndex::new(2, 100, None);
    idx.lock().nodes = nodes::Nodes::with_limit(6);
    idx.insert(0, &chain(1, 4));
    idx.insert(1, &chain(2, 4));
    assert_eq!(idx.blocks(), vec![4, 2], "two nodes left: the chain's first two blocks");
    assert_eq!(idx.depths(&chain(1, 4))[0], 4);
    assert_eq!(idx.depths(&chain(2, 4))[1], 2);
    // Backend 1's own oldest make room for its next chain.
    idx.insert(1, &chain(3, 2));
    assert_eq!((idx.depths(&chain(3, 2))[1], idx.blocks()[1]), (2, 2));
    idx.clear(0);
    idx.insert(1, &chain(2, 4));
    assert_eq!(idx.depths(&chain(2, 4))[1], 4, "freed nodes serve again");
}
