//! The on-disk cache of compiled generated kernels (NVRTC's PTX, hipcc's code objects).
//!
//! An entry is one file, `<hash>.bin`, named by a 64-bit FNV-1a hash of its key (the generated
//! source, the compiler's options, target and version) and holding the key itself before the
//! compiled bytes, so a lookup compares the whole key: two keys whose hashes collide never share
//! an entry, they replace each other. An entry is written to a scratch file and renamed into
//! place, so a reader (in this process or another) sees a whole entry or none. A file that does
//! not parse is a miss. Nothing here is required: a cache that cannot be read or written costs a
//! compile, and the error is the caller's to log.

use std::io;
use std::path::{Path, PathBuf};

/// The first bytes of every entry (and the entry format's version).
const MAGIC: &[u8; 8] = b"vllmir1\n";

/// A directory of compiled kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskCache {
    dir: PathBuf,
}

impl DiskCache {
    /// A cache in `dir` (created at the first store).
    pub fn new(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache { dir: dir.into() }
    }

    /// The cache the environment names: `VLLM_IR_KERNEL_CACHE` (a directory; empty or `off` turns
    /// the cache off), else `vllm-ir/kernels` under `XDG_CACHE_HOME` or `~/.cache`; `None` when it
    /// is off or no directory is known.
    pub fn from_env() -> Option<DiskCache> {
        match std::env::var_os("VLLM_IR_KERNEL_CACHE") {
            Some(dir) if dir.is_empty() || dir == "off" => None,
            Some(dir) => Some(DiskCache::new(dir)),
            None => {
                let base =
                    std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()).map(PathBuf::from).or_else(|| {
                        std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| Path::new(&h).join(".cache"))
                    })?;
                Some(DiskCache::new(base.join("vllm-ir").join("kernels")))
            }
        }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> PathBuf {
        let hash = key
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3));
        self.dir.join(format!("{hash:016x}.bin"))
    }

    /// The bytes stored under `key`, or `None` (no entry, another key's entry, an entry that does
    /// not parse, or an error reading it).
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let bytes = std::fs::read(self.path(key)).ok()?;
        let rest = bytes.strip_prefix(MAGIC)?;
        let (len, rest) = rest.split_first_chunk::<8>()?;
        let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
        if rest.len() < len || &rest[..len] != key.as_bytes() {
            return None;
        }
        Some(rest[len..].to_vec())
    }

    /// Stores `value` under `key`, replacing what the key's file held.
    pub fn put(&self, key: &str, value: &[u8]) -> io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.path(key);
        let scratch = path.with_extension(format!("{}.{:?}.tmp", std::process::id(), std::thread::current().id()));
        let mut bytes = Vec::with_capacity(MAGIC.len() + 8 + key.len() + value.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(key.len() as u64).to_le_bytes());
        bytes.extend_from_slice(key.as_bytes());
        bytes.extend_from_slice(value);
        std::fs::write(&scratch, &bytes)?;
        std::fs::rename(&scratch, &path).inspect_err(|_| {
            let _ = std::fs::remove_file(&scratch);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vllm-ir-cache-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn an_entry_is_found_by_its_whole_key() {
        let dir = scratch_dir("key");
        let cache = DiskCache::new(&dir);
        assert_eq!(cache.get("source a"), None, "an empty cache misses");
        cache.put("source a", b"ptx a").unwrap();
        assert_eq!(cache.get("source a").as_deref(), Some(&b"ptx a"[..]));
        assert_eq!(cache.get("source b"), None);
        // Another key's bytes under this key's file name (a hash collision) are a miss.
        let path = cache.path("source b");
        std::fs::copy(cache.path("source a"), &path).unwrap();
        assert_eq!(cache.get("source b"), None, "a colliding entry is not this key's");
        cache.put("source b", b"ptx b").unwrap();
        assert_eq!(cache.get("source b").as_deref(), Some(&b"ptx b"[..]));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_entry_is_a_miss() {
        let dir = scratch_dir("damaged");
        let cache = DiskCache::new(&dir);
        cache.put("key", b"value").unwrap();
        let path = cache.path("key");
        let whole = std::fs::read(&path).unwrap();
        for cut in [0, 4, MAGIC.len() + 3, MAGIC.len() + 8 + 1] {
            std::fs::write(&path, &whole[..cut]).unwrap();
            assert_eq!(cache.get("key"), None, "an entry cut at {cut} bytes");
        }
        let mut wrong_len = whole.clone();
        wrong_len[MAGIC.len()..MAGIC.len() + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&path, &wrong_len).unwrap();
        assert_eq!(cache.get("key"), None, "a length past the file");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_cache_that_cannot_be_written_says_so() {
        let dir = scratch_dir("unwritable");
        std::fs::write(&dir, b"a file, not a directory").unwrap();
        let cache = DiskCache::new(dir.join("kernels"));
        assert!(cache.put("key", b"value").is_err());
        assert_eq!(cache.get("key"), None);
        let _ = std::fs::remove_file(&dir);
    }
}
