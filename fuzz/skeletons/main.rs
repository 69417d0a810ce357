//! A kvproto/1 cache adapter in Rust (written by `kvspec adapter new --lang rust`).
//!
//! kvspec starts this program, writes one JSON request per line on stdin and
//! reads one JSON reply per line on stdout (docs/targets.md, "The line
//! protocol"). As written it is a correct dense cache (mode fp16: rows kept
//! as given, logical trim, copied snapshots, a held window), so
//!
//!     cargo build --release
//!     kvspec adapter check ./target/release/kvspec-adapter       # the protocol
//!     kvspec fuzz --target exec:./target/release/kvspec-adapter  # the contract, fuzzed
//!
//! both pass before you change anything. Then put your engine's cache behind
//! `struct Cache` (search for "YOUR CACHE"). Only the standard library is used
//! (a small JSON reader below; swap in serde_json if you like). stdout carries
//! protocol lines only (log to stderr).

use std::collections::BTreeMap;
use std::io::{self, BufRead, Write};

// -- what the adapter declares (hello) ------------------------------------------
// Declare only what your cache does: an op left out is never sent, an observable
// left out is not compared, a cache field left out is never sent (your cache runs
// at its default). Add "inplace" only if your cache has an in-place write switch.
const ADAPTER: &str = "my-dense-cache-rust";
const DTYPES: &[&str] = &["float16", "bfloat16", "float32"];
const FIELDS: &[&str] = &["kind", "mode", "step", "batch", "kv_heads", "head_dim", "k_head_dim", "v_head_dim", "dtype", "rows"];
const OPS: &[&str] = &["append", "fetch", "hold", "release_hold", "trim", "trim_to", "snapshot", "restore", "drop"];
const OBSERVABLES: &[&str] = &["offset", "live_start", "live_len"];

// -- the portable row function (docs/kvtrace.md "Portable rows"): copy as it is --
fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85EB_CA6B);
    x ^= x >> 13;
    x = x.wrapping_mul(0xC2B2_AE35);
    x ^ (x >> 16)
}

fn element_bits(t: u32, kv: u32, b: u32, h: u32, c: u32, dtype: &str, wide: bool) -> u32 {
    let place = ((kv * 64 + b) * 64 + h) * 1024 + c;
    let mut z = t.wrapping_mul(0x9E37_79B1) & 0xFF_FFFF;
    z ^= z >> 12;
    let salt = mix32(place);
    let u = ((z >> (12 * ((kv + b + h + c) & 1))) & 0xFFF) ^ (salt & 0xFFF);
    let x = mix32(salt ^ t) >> 16;
    let (sign, e, m) = (u >> 11, (u >> 7) & 15, u & 127);
    if dtype == "float16" {
        return (sign << 15) | ((7 + e) << 10) | (m << 3) | (x >> 13);
    }
    let exp = 119 + e + if wide && t % 5 == 2 { 24 } else { 0 };
    if dtype == "bfloat16" {
        return (sign << 15) | (exp << 7) | m;
    }
    (sign << 31) | (exp << 23) | (m << 16) | x
}

// -- a small JSON value, reader and writer ----------------------------------------
#[derive(Clone, Debug)]
#[allow(dead_code)]
enum J {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<J>),
    Obj(BTreeMap<String, J>),
}

impl J {
    fn get(&self, key: &str) -> Option<&J> {
        match self {
            J::Obj(m) => m.get(key),
            _ => None,
        }
    }
    fn int(&self, key: &str) -> Option<i64> {
        match self.get(key) {
            Some(J::Num(n)) => Some(*n as i64),
            _ => None,
        }
    }
    fn str(&self, key: &str) -> Option<&str> {
        match self.get(key) {
            Some(J::Str(s)) => Some(s.as_str()),
            _ => None,
        }
    }
}

struct Reader<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Reader<'a> {
    fn ws(&mut self) {
        while self.i < self.s.len() && (self.s[self.i] as char).is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn value(&mut self) -> Result<J, String> {
        self.ws();
        match self.s.get(self.i).copied() {
            Some(b'{') => {
                self.i += 1;
                let mut m = BTreeMap::new();
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(J::Obj(m));
                }
                loop {
                    self.ws();
                    let k = match self.value()? {
                        J::Str(k) => k,
                        _ => return Err("object key".into()),
                    };
                    self.ws();
                    if self.s.get(self.i) != Some(&b':') {
                        return Err("':'".into());
                    }
                    self.i += 1;
                    let v = self.value()?;
                    m.insert(k, v);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(J::Obj(m));
                        }
                        _ => return Err("',' or '}'".into()),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut a = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(J::Arr(a));
                }
                loop {
                    a.push(self.value()?);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(J::Arr(a));
                        }
                        _ => return Err("',' or ']'".into()),
                    }
                }
            }
            Some(b'"') => {
                self.i += 1;
                let mut out = String::new();
                loop {
                    let c = *self.s.get(self.i).ok_or("unterminated string")?;
                    self.i += 1;
                    match c {
                        b'"' => return Ok(J::Str(out)),
                        b'\\' => {
                            let e = *self.s.get(self.i).ok_or("escape")?;
                            self.i += 1;
                            match e {
                                b'n' => out.push('\n'),
                                b't' => out.push('\t'),
                                b'r' => out.push('\r'),
                                b'b' => out.push('\u{8}'),
                                b'f' => out.push('\u{c}'),
                                b'u' => {
                                    let hex = std::str::from_utf8(self.s.get(self.i..self.i + 4).ok_or("\\u")?)
                                        .map_err(|_| "\\u")?;
                                    let cp = u32::from_str_radix(hex, 16).map_err(|_| "\\u")?;
                                    self.i += 4;
                                    out.push(char::from_u32(cp).unwrap_or('\u{fffd}'));
                                }
                                other => out.push(other as char),
                            }
                        }
                        _ => {
                            // copy one UTF-8 sequence
                            let start = self.i - 1;
                            let mut end = self.i;
                            while end < self.s.len() && (self.s[end] & 0xC0) == 0x80 {
                                end += 1;
                            }
                            out.push_str(&String::from_utf8_lossy(&self.s[start..end]));
                            self.i = end;
                        }
                    }
                }
            }
            Some(b't') if self.s[self.i..].starts_with(b"true") => {
                self.i += 4;
                Ok(J::Bool(true))
            }
            Some(b'f') if self.s[self.i..].starts_with(b"false") => {
                self.i += 5;
                Ok(J::Bool(false))
            }
            Some(b'n') if self.s[self.i..].starts_with(b"null") => {
                self.i += 4;
                Ok(J::Null)
            }
            Some(_) => {
                let start = self.i;
                while self.i < self.s.len() && b"+-0123456789.eE".contains(&self.s[self.i]) {
                    self.i += 1;
                }
                std::str::from_utf8(&self.s[start..self.i])
                    .ok()
                    .and_then(|t| t.parse::<f64>().ok())
                    .map(J::Num)
                    .ok_or_else(|| "a value".to_string())
            }
            None => Err("end of line".into()),
        }
    }
}

fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn list(items: &[&str]) -> String {
    format!("[{}]", items.iter().map(|s| quote(s)).collect::<Vec<_>>().join(","))
}

// -- YOUR CACHE ---------------------------------------------------------------------
/// A refusal: category invalid_argument, state or unsupported (the spec's error
/// types); the message is free text kvspec never compares.
struct Refused(&'static str, String);

type Row = (Vec<u8>, Vec<u8>); // one token's K [B,H,Dk] and V [B,H,Dv] bytes

/// A dense cache of rows. Replace the Vec of rows by your engine's cache: keep
/// the method names, and the protocol loop in main() works unchanged.
struct Cache {
    b: u32,
    h: u32,
    dk: u32,
    dv: u32,
    dtype: String,
    width: usize,
    wide: bool,
    rows: Vec<Row>,
    returned: Option<Vec<Row>>,
    held: Option<Vec<Row>>,
    snapshots: BTreeMap<String, Vec<Row>>,
}

impl Cache {
    /// YOUR CACHE: build your engine's cache from the trace's fields (those
    /// FIELDS declares; the rest are at their defaults).
    fn new(cache: &J, wide: bool) -> Cache {
        let d = cache.int("head_dim").unwrap_or(8) as u32;
        let dtype = cache.str("dtype").unwrap_or("float16").to_string();
        Cache {
            b: cache.int("batch").unwrap_or(1) as u32,
            h: cache.int("kv_heads").unwrap_or(2) as u32,
            dk: cache.int("k_head_dim").map(|x| x as u32).unwrap_or(d),
            dv: cache.int("v_head_dim").map(|x| x as u32).unwrap_or(d),
            width: if dtype == "float32" { 4 } else { 2 },
            dtype,
            wide,
            rows: Vec::new(),
            returned: None,
            held: None,
            snapshots: BTreeMap::new(),
        }
    }

    fn row(&self, t: u32, kv: u32) -> Vec<u8> {
        let d = if kv == 1 { self.dv } else { self.dk };
        let mut out = Vec::new();
        for b in 0..self.b {
            for h in 0..self.h {
                for c in 0..d {
                    let bits = element_bits(t, kv, b, h, c, &self.dtype, self.wide);
                    out.extend_from_slice(&bits.to_le_bytes()[..self.width]);
                }
            }
        }
        out
    }

    fn append(&mut self, n: i64, first: i64) -> Result<Vec<Row>, Refused> {
        if n < 1 {
            return Err(Refused("invalid_argument", format!("append: n must be >= 1, got {n}")));
        }
        // YOUR CACHE: hand these rows to your engine's append (update_and_fetch)
        for t in first..first + n {
            let row = (self.row(t as u32, 0), self.row(t as u32, 1));
            self.rows.push(row);
        }
        self.returned = Some(self.rows.clone());
        Ok(self.rows.clone())
    }

    fn trim(&mut self, n: i64) -> i64 {
        let n = n.clamp(0, self.rows.len() as i64);
        self.rows.truncate(self.rows.len() - n as usize);
        n
    }

    fn trim_to(&mut self, len: i64) -> Result<i64, Refused> {
        if len < 0 || len > self.rows.len() as i64 {
            return Err(Refused("invalid_argument",
                               format!("trim_to: len must satisfy 0 <= len <= offset ({}), got {len}", self.rows.len())));
        }
        Ok(self.trim(self.rows.len() as i64 - len))
    }

    fn op(&mut self, op: &J, first: i64) -> Result<Option<String>, Refused> {
        let name = op.str("op").unwrap_or("");
        let arg = |k: &str| op.int(k).unwrap_or(0);
        let key = op.str("name").unwrap_or("").to_string();
        match name {
            "append" => {
                let w = self.append(arg("n"), first)?;
                Ok(Some(self.window(Some(&w))))
            }
            "fetch" => Ok(None),
            "trim" => Ok(Some(self.trim(arg("n")).to_string())),
            "trim_to" => Ok(Some(self.trim_to(op.int("len").unwrap_or(-1))?.to_string())),
            "hold" => match &self.returned {
                None => Err(Refused("state", "hold: no append has returned a window yet".into())),
                Some(w) => {
                    self.held = Some(w.clone());
                    Ok(None)
                }
            },
            "release_hold" => {
                self.held = None;
                Ok(None)
            }
            "snapshot" => {
                if self.snapshots.contains_key(&key) {
                    return Err(Refused("state", format!("snapshot: name {key} is already in use")));
                }
                self.snapshots.insert(key, self.rows.clone()); // a copy: later writes never show in it
                Ok(None)
            }
            "restore" => match self.snapshots.get(&key) {
                None => Err(Refused("state", format!("restore: no snapshot named {key}"))),
                Some(rows) => {
                    self.rows = rows.clone();
                    Ok(None)
                }
            },
            "drop" => match self.snapshots.remove(&key) {
                None => Err(Refused("state", format!("drop: no snapshot named {key}"))),
                Some(_) => Ok(None),
            },
            other => Err(Refused("unsupported", format!("{other}: not an op of this adapter"))),
        }
    }

    /// K and V as [B, H, n, D] in C order, little-endian, lowercase hex.
    /// YOUR CACHE: read your engine's tensors back here (their bytes).
    fn window(&self, rows: Option<&Vec<Row>>) -> String {
        let rows = match rows {
            None => return "null".into(),
            Some(r) => r,
        };
        let mut sides = Vec::new();
        for (kv, d) in [(0usize, self.dk), (1usize, self.dv)] {
            let size = d as usize * self.width;
            let mut hex = String::new();
            for i in 0..(self.b * self.h) as usize {
                for r in rows {
                    let bytes = if kv == 0 { &r.0 } else { &r.1 };
                    for byte in &bytes[i * size..(i + 1) * size] {
                        hex.push_str(&format!("{byte:02x}"));
                    }
                }
            }
            sides.push(hex);
        }
        format!("{{\"rows\":{},\"k\":\"{}\",\"v\":\"{}\"}}", rows.len(), sides[0], sides[1])
    }

    fn state(&self) -> String {
        let mut parts = Vec::new();
        for name in OBSERVABLES {
            let value = match *name {
                "offset" | "live_len" => self.rows.len(),
                _ => 0, // live_start: no front trim, the live window starts at row 0
            };
            parts.push(format!("\"{name}\":{value}"));
        }
        parts.push(format!("\"cache\":{}", self.window(Some(&self.rows))));
        parts.push(format!("\"held\":{}", self.window(self.held.as_ref())));
        let holders: Vec<String> =
            self.snapshots.iter().map(|(k, rows)| format!("{}:{}", quote(k), self.window(Some(rows)))).collect();
        parts.push(format!("\"holders\":{{{}}}", holders.join(",")));
        format!("{{{}}}", parts.join(","))
    }
}

// -- the protocol loop (no change needed) --------------------------------------------
fn main() {
    let stdin = io::stdin();
    let mut out = io::stdout().lock();
    let mut cache: Option<Cache> = None;
    for line in stdin.lock().lines() {
        let line = match line {
            Ok(l) => l,
            Err(_) => break,
        };
        let req = match (Reader { s: line.as_bytes(), i: 0 }).value() {
            Ok(j) => j,
            Err(e) => {
                eprintln!("malformed request ({e}): {line}");
                continue;
            }
        };
        let id = req.int("id").unwrap_or(-1);
        let reply = match req.str("request").unwrap_or("") {
            "bye" => break,
            "hello" => format!(
                "{{\"id\":{id},\"kvproto\":1,\"adapter\":{},\"version\":\"0.1\",\"windows\":\"bytes\",\"kinds\":{{\"dense\":\
                 {{\"modes\":[\"fp16\"],\"dtypes\":{},\"fields\":{},\"ops\":{},\"observables\":{}}}}}}}",
                quote(ADAPTER), list(DTYPES), list(FIELDS), list(OPS), list(OBSERVABLES)),
            "init" => {
                let wide = matches!(req.get("wide"), Some(J::Bool(true)));
                let c = Cache::new(req.get("cache").unwrap_or(&J::Null), wide);
                let r = format!("{{\"id\":{id},\"ok\":true,\"state\":{}}}", c.state());
                cache = Some(c);
                r
            }
            "op" if cache.is_some() => {
                let c = cache.as_mut().unwrap();
                let first = req.int("first").unwrap_or(0);
                match c.op(req.get("op").unwrap_or(&J::Null), first) {
                    Ok(result) => format!("{{\"id\":{id},\"ok\":true,\"result\":{},\"state\":{}}}",
                                          result.unwrap_or_else(|| "null".into()), c.state()),
                    Err(Refused(cat, msg)) => format!(
                        "{{\"id\":{id},\"ok\":false,\"error\":{{\"category\":\"{cat}\",\"message\":{}}},\"state\":{}}}",
                        quote(&msg), c.state()),
                }
            }
            _ => format!("{{\"id\":{id},\"ok\":false,\"error\":{{\"category\":\"state\",\"message\":\"send init first\"}},\
                          \"state\":{{\"cache\":[],\"held\":null,\"holders\":{{}}}}}}"),
        };
        writeln!(out, "{reply}").ok();
        out.flush().ok();
    }
}
