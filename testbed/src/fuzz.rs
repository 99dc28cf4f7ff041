//! A byte-mutation fuzzer for the parsers of outside input, on stable Rust.
//!
//! Each case takes an input from the seed corpus (the captured files of
//! `fixtures/`, plus inputs a target builds), stacks one to eight random
//! mutations on it (bit flips, interesting bytes, insertions, deletions,
//! repeats, splices with another input, a dictionary token, truncation),
//! and hands it to the target's check, which asserts properties, not only
//! the absence of a panic. Not coverage-guided (that needs nightly Rust for
//! cargo-fuzz, or AFL's compiler): it makes up for it with many cases from
//! inputs that are already nearly right.
//!
//! Deterministic: the cases follow from `FUZZ_SEED` (a fixed default), and
//! `FUZZ_CASES` says how many per target (a few thousand by default, a few
//! seconds in CI). A failing case is written to
//! `target/fuzz-failures/<target>-<hash>` with the seed, and the panic names
//! the file: add it to `fixtures/fuzz/<target>/`, where every file is run
//! before the mutations, as a regression case.
use std::fs;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Cases per target when `FUZZ_CASES` is not set.
pub const DEFAULT_CASES: u64 = 3000;
/// The seed when `FUZZ_SEED` is not set.
pub const DEFAULT_SEED: u64 = 0x5eed_f00d;

/// What one target's run did.
#[derive(Clone, Debug)]
pub struct Stats {
    pub target: &'static str,
    /// Inputs checked: the regression files, the corpus, then the mutants.
    pub executions: u64,
    pub elapsed: Duration,
}

impl Stats {
    pub fn per_second(&self) -> f64 {
        self.executions as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A fuzzing run of one target.
pub struct Fuzzer {
    target: &'static str,
    corpus: Vec<Vec<u8>>,
    dictionary: Vec<Vec<u8>>,
    regressions: Vec<(PathBuf, Vec<u8>)>,
    rng: SplitMix,
    seed: u64,
    cases: u64,
    max_len: usize,
}

impl Fuzzer {
    /// A target named `target`, its regression cases read from
    /// `fixtures/fuzz/<target>/` under `repo` (none yet is fine).
    pub fn new(target: &'static str, repo: &Path) -> Self {
        let seed = env_number("FUZZ_SEED").unwrap_or(DEFAULT_SEED);
        let cases = env_number("FUZZ_CASES").unwrap_or(DEFAULT_CASES);
        let mut regressions = Vec::new();
        if let Ok(entries) = fs::read_dir(repo.join("fixtures/fuzz").join(target)) {
            let mut paths: Vec<PathBuf> = entries.filter_map(|entry| Some(entry.ok()?.path())).collect();
            paths.sort();
            for path in paths {
                if let Ok(bytes) = fs::read(&path) {
                    regressions.push((path, bytes));
                }
            }
        }
        // Each target its own stream, so adding one changes no other's cases.
        let rng = SplitMix(seed ^ hash_of(target));
        Fuzzer { target, corpus: Vec::new(), dictionary: Vec::new(), regressions, rng, seed, cases, max_len: 1 << 16 }
    }

    /// Adds the files of `dir` (a fixtures folder) whose names end in
    /// `extension` to the corpus.
    pub fn corpus_dir(mut self, dir: &Path, extension: &str) -> Self {
        let mut paths: Vec<PathBuf> = fs::read_dir(dir)
            .unwrap_or_else(|err| panic!("corpus {}: {err}", dir.display()))
            .filter_map(|entry| Some(entry.ok()?.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == extension))
            .collect();
        paths.sort();
        for path in paths {
            let bytes = fs::read(&path).unwrap_or_else(|err| panic!("corpus {}: {err}", path.display()));
            self.corpus.push(bytes);
        }
        self
    }

    /// Adds inputs built by the target itself.
    pub fn corpus(mut self, inputs: impl IntoIterator<Item = Vec<u8>>) -> Self {
        self.corpus.extend(inputs);
        self
    }

    /// Tokens worth inserting whole (keywords, delimiters, magic numbers).
    pub fn dictionary<T: AsRef<[u8]>>(mut self, tokens: impl IntoIterator<Item = T>) -> Self {
        self.dictionary.extend(tokens.into_iter().map(|token| token.as_ref().to_vec()));
        self
    }

    /// Checks every regression case, every corpus input, then `FUZZ_CASES`
    /// mutants. `check` panics on a property that does not hold.
    pub fn run(mut self, mut check: impl FnMut(&[u8])) -> Stats {
        assert!(!self.corpus.is_empty(), "fuzz target {} has no corpus", self.target);
        let started = Instant::now();
        let mut executions = 0;
        for (path, input) in std::mem::take(&mut self.regressions) {
            self.check_one(&input, &mut check, Some(&path));
            executions += 1;
        }
        for index in 0..self.corpus.len() {
            let input = self.corpus[index].clone();
            self.check_one(&input, &mut check, None);
            executions += 1;
        }
        for _ in 0..self.cases {
            let input = self.mutant();
            self.check_one(&input, &mut check, None);
            executions += 1;
        }
        let stats = Stats { target: self.target, executions, elapsed: started.elapsed() };
        eprintln!(
            "fuzz {}: {} executions in {:.2} s ({:.0}/s), seed {:#x}, no failure",
            stats.target,
            stats.executions,
            stats.elapsed.as_secs_f64(),
            stats.per_second(),
            self.seed
        );
        stats
    }

    fn check_one(&self, input: &[u8], check: &mut impl FnMut(&[u8]), regression: Option<&Path>) {
        let Err(panic) = panic::catch_unwind(AssertUnwindSafe(|| check(input))) else { return };
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("(no message)");
        let saved = match regression {
            Some(path) => format!("regression case {}", path.display()),
            None => self.save_failure(input),
        };
        panic!("fuzz {}: {message}\n  input: {saved} (seed {:#x})", self.target, self.seed);
    }

    /// Writes a failing input where the panic can name it.
    fn save_failure(&self, input: &[u8]) -> String {
        let dir = repo().join("target/fuzz-failures");
        let path = dir.join(format!("{}-{:016x}", self.target, hash_of(input)));
        match fs::create_dir_all(&dir).and_then(|()| fs::write(&path, input)) {
            Ok(()) => path.display().to_string(),
            Err(err) => format!("not saved ({err}): {:?}", String::from_utf8_lossy(input)),
        }
    }

    fn mutant(&mut self) -> Vec<u8> {
        let mut input = self.corpus[self.rng.below(self.corpus.len())].clone();
        for _ in 0..1 + self.rng.below(8) {
            self.mutate(&mut input);
        }
        input.truncate(self.max_len);
        input
    }

    fn mutate(&mut self, input: &mut Vec<u8>) {
        const INTERESTING: [u8; 12] = [0, 1, 0x7f, 0x80, 0xff, b'\n', b'\r', b' ', b'\\', b'"', b'-', b':'];
        let rng = &mut self.rng;
        let len = input.len();
        match rng.below(10) {
            0 if len > 0 => {
                let at = rng.below(len);
                input[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                input[at] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => {
                let at = rng.below(len + 1);
                let bytes: Vec<u8> = (0..1 + rng.below(8)).map(|_| rng.next() as u8).collect();
                input.splice(at..at, bytes);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let end = (at + 1 + rng.below(32)).min(len);
                input.drain(at..end);
            }
            4 if len > 0 => {
                // A piece repeated: a line twice, a field doubled.
                let at = rng.below(len);
                let end = (at + 1 + rng.below(64)).min(len);
                let piece = input[at..end].to_vec();
                let to = rng.below(len + 1);
                input.splice(to..to, piece);
            }
            5 => {
                let other = &self.corpus[rng.below(self.corpus.len())];
                if !other.is_empty() {
                    let from = rng.below(other.len());
                    let end = (from + 1 + rng.below(256)).min(other.len());
                    let at = rng.below(len + 1);
                    input.splice(at..at, other[from..end].iter().copied());
                }
            }
            6 if !self.dictionary.is_empty() => {
                let token = self.dictionary[rng.below(self.dictionary.len())].clone();
                let at = rng.below(len + 1);
                input.splice(at..at, token);
            }
            7 if len > 0 => input.truncate(rng.below(len)),
            8 if len > 1 => {
                // Two bytes swapped: fields out of order, a digit moved.
                let (a, b) = (rng.below(len), rng.below(len));
                input.swap(a, b);
            }
            _ if len > 0 => {
                // A byte off by a little: a length, a digit, a type.
                let at = rng.below(len);
                let delta = [1u8, 255, 16, 240][rng.below(4)];
                input[at] = input[at].wrapping_add(delta);
            }
            _ => input.push(rng.next() as u8),
        }
    }
}

/// The repository's root, for fixtures.
pub fn repo() -> PathBuf {
    // This crate is one folder of the workspace.
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from(".."), Path::to_path_buf)
}

fn env_number(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    let parsed = match value.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => value.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={value:?} is not a number")))
}

fn hash_of(value: impl Hash) -> u64 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// SplitMix64: small, fast, and the same on every machine.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..bound` (`bound` > 0).
    fn below(&mut self, bound: usize) -> usize {
        (self.next() % bound as u64) as usize
    }
}

/// A mountinfo line as the kernel prints `mount` (no newline): the
/// serialiser the parser's round trip is checked with. Unknown optional
/// fields are not kept by the parser, so none are printed.
pub fn mountinfo_line(mount: &fuse_supervisor_engine::model::mountinfo::MountInfo<'_>) -> Vec<u8> {
    let numbers = format!("{} {} {}:{}", mount.mount_id, mount.parent_id, mount.major, mount.minor);
    let root = [mount.root.raw(), if mount.root_deleted { b"//deleted" } else { b"" }].concat();
    let propagation = &mount.propagation;
    let tags = [
        ("shared", propagation.shared),
        ("master", propagation.master),
        ("propagate_from", propagation.propagate_from),
    ];
    let mut optional: Vec<String> =
        tags.into_iter().filter_map(|(tag, group)| Some(format!("{tag}:{}", group?))).collect();
    if propagation.unbindable {
        optional.push("unbindable".into());
    }
    let mut fields: Vec<&[u8]> =
        vec![numbers.as_bytes(), &root, mount.mount_point.raw(), mount.mount_options.as_bytes()];
    fields.extend(optional.iter().map(String::as_bytes));
    fields.extend([&b"-"[..], mount.fs_type.as_bytes(), mount.source.raw(), mount.super_options.as_bytes()]);
    fields.join(&b' ')
}
